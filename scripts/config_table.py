"""Print the README's config-key table (markdown) from the typed schema in rlkit/config.py.

python scripts/config_table.py > /tmp/keys.md     # paste into README.md "Config keys"
"""

from rlkit.config.schema import field_docs


def main() -> None:
    group = None
    for key, default, doc in field_docs():
        g = key.split(".")[0]
        if g != group:
            group = g
            print(f"\n**{g}**\n\n| key | default | meaning |\n|---|---|---|")
        print(f"| `{key}` | `{default!r}` | {doc.replace('|', '/')} |")


if __name__ == "__main__":
    main()
