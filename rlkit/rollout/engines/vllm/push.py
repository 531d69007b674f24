"""The engine side of a push into vLLM (a family's push must be right or loud): what the stream becomes on its way in, what the reload
reported, and which of vLLM's tensors the push check reads.

- Names and layouts: the learner streams transformers' in-memory names; vLLM's loaders expect the
  checkpoint's (`checkpoint_format.to_checkpoint`). A tied output head is also pushed under its alias where
  vLLM's model has that module (on CPU the head is a separately processed layer; Gemma 2 has none).
- The reload (`vllm.reload.worker_reload`) reports the layers it left stale: a `WeightSyncError` naming them;
  and which engine tensors each pushed tensor wrote: with `checkpoint_origins`, the push check's sources.
- Digests (rlkit.digests, on the engine's device): what each push received, tensor by tensor in the learner's
  names; what vLLM's loaders wrote into each of its tensors and what that tensor holds after the push, a
  repacked linear read back from its kernel (vllm_content); and, for the tensors that check cannot read (values
  changed by processing, as the CPU expert prepack), the whole tensor as held, for the check by change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from rlkit.digests import tensor_digest, to_host
from rlkit.rollout.engines.vllm.checkpoint_format import checkpoint_origins, to_checkpoint
from rlkit.rollout.engines.vllm.content import Layouts, expected_digests
from rlkit.rollout.engines.vllm.reload import (
    worker_digests,
    worker_held_digests,
    worker_module_names,
    worker_tensors,
    worker_vision_prefixes,
)
from rlkit.verify import engine_sources
from rlkit.weights import WeightSyncError


class PushBook:
    """Per engine: the weightless transformers model, the tied aliases, and what the pushes recorded."""

    def __init__(self, meta, manifest: dict, aliases: dict[str, list[str]], platform: str):
        self.meta, self.aliases, self.platform = meta, aliases, platform
        self.origins = checkpoint_origins(meta, manifest)
        for name, names in aliases.items():
            for alias in names:
                self.origins[alias] = [name]
        self.loads: dict[str, list[str]] = {}
        self.layouts = Layouts()  # the content check's maps and this push's expected digests
        self.last_loads: dict[str, list[str]] = {}  # what the last push's loaders wrote
        self.received: dict[str, str] | None = (
            None  # {learner name: digest} of the last push; None before one
        )
        self._modules: set[str] | None = None
        self._held: list[str] | None = None
        self._prefixes: list[str] | None = None
        self._frozen: dict[str, str] | None = None  # {vLLM tensor: digest} of the frozen vision side, as kept
        self.unwritten: set[str] = (
            set()
        )  # vLLM tensors the last push left out on purpose (a frozen vision side)

    def checkpoint_stream(self, llm, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """`named` (in-memory names) in checkpoint names and layouts, with the aliases vLLM's model has."""
        if self._modules is None:
            self._modules = set(llm.collective_rpc(worker_module_names)[0])
        aliases = {
            n: [a for a in al if a.rpartition(".")[0] in self._modules] for n, al in self.aliases.items()
        }
        for name, tensor in to_checkpoint(named, self.meta):
            yield name, tensor
            for alias in aliases.get(name, ()):
                yield alias, tensor

    def received_stream(self, named: Iterable[tuple[str, Tensor]], dtype) -> Iterator[tuple[str, Tensor]]:
        """`named` as it is, digesting each tensor in the engine's `dtype` (what it holds) as it arrives
        (`received`, set when the stream ends)."""
        self.received, seen = {}, {}
        for name, tensor in named:
            tensor = tensor.to(dtype)
            seen[name] = tensor_digest(tensor)
            self.layouts.seen[id(tensor)] = (tensor, seen[name])  # a loader given this very tensor reuses it
            yield name, tensor
        self.received = to_host(seen)

    def record(self, report: dict) -> None:
        """Keep what the reload's loaders wrote; raise naming the layers it left stale."""
        self.last_loads = report["loads"]
        for ck, targets in report["loads"].items():
            self.loads[ck] = sorted(set(self.loads.get(ck, ())) | set(targets))
        stale = report["missed"] + report["partial"]
        if stale:
            import vllm

            raise WeightSyncError(
                f"vLLM's weight reload left {stale[:4]}{' ...' if len(stale) > 4 else ''} ({len(stale)} layers) "
                f"stale: {len(report['missed'])} received none of their weights (vLLM logs 'Failed to load "
                f"weights' and keeps the old ones), {len(report['partial'])} only part of them. vLLM "
                f"{vllm.__version__}'s in-place reload does not update this model's layers on the {self.platform} "
                "platform: train it with rollout.engine=hf"
            )

    def vision_prefixes(self, llm) -> list[str]:
        """vLLM's module prefixes of the vision tower and connector (the model's `get_mm_mapping()`)."""
        if self._prefixes is None:
            self._prefixes = llm.collective_rpc(worker_vision_prefixes)[0]
        return self._prefixes

    def _under(self, llm, prefixes) -> list[str]:
        """vLLM's tensors under `prefixes`: held ones, and the content check's (a repacked CPU linear's weight is
        emptied, read back from its kernel)."""
        names = set(self.held(llm)) | set(self.layouts.targets())
        return sorted(n for n in names if any(n.startswith(f"{p}.") for p in prefixes))

    def freeze(self, llm, prefixes) -> None:
        """Before a push that leaves the vision side out: the digests it must keep (taken at the first such push
        after one that brought it)."""
        if self._frozen is None:
            self._frozen = self.digests(llm, set(self._under(llm, prefixes)))

    def check_frozen(self, llm, frozen: list[str]) -> None:
        """After a push: with the vision side left out (`frozen`, learner names), every vLLM tensor under its
        prefixes that no loader wrote holds what it held when it was frozen (`WeightSyncError` naming them);
        a push that brought the vision side ends the frozen state."""
        if not frozen:
            self._frozen, self.unwritten = None, set()
            return
        written = {t for targets in self.last_loads.values() for t in targets}
        kept = {n: d for n, d in self._frozen.items() if n.split("#")[0] not in written}
        self.unwritten = {n.split("#")[0] for n in kept}  # checked here, not by the push's content check
        now = self.digests(llm, self.unwritten)
        changed = sorted(n for n, d in kept.items() if now.get(n) != d)
        if changed or not kept:
            raise WeightSyncError(
                f"the push left the frozen vision side out ({len(frozen)} tensors, e.g. {frozen[:2]}), but vLLM's "
                f"{changed[:3] or 'vision tensors'} ({len(changed)}) did not keep their weights"
            )

    def held(self, llm) -> list[str]:
        """vLLM's tensors whose bytes a push determines: every parameter and persistent buffer not emptied."""
        if self._held is None:
            held = set()
            for worker in llm.collective_rpc(worker_tensors):
                held |= {n for n, numel in worker.items() if numel > 0}
            self._held = sorted(held)
        return self._held

    def digests(self, llm, names=None) -> dict[str, str]:
        """The digests of what vLLM holds (of `names` only, unless None): each tensor the content check reads,
        at the positions a push writes (and `#kernel`: read back from its packed kernel); every other tensor a
        push determines, whole (for the check by change)."""
        content = set(self.layouts.targets()) if self.layouts.mapped else set()
        wanted = [n for n in self.held(llm) if n not in content and (names is None or n in names)]
        out = {}
        for worker in llm.collective_rpc(worker_digests, kwargs={"names": wanted}):
            out.update(worker)
        if content:
            for worker in llm.collective_rpc(worker_held_digests, kwargs={"layouts": self.layouts}):
                out.update({n: d for n, d in worker.items() if names is None or n.split("#")[0] in names})
        return out

    def expected(self) -> dict[str, str]:
        """{vLLM tensor: the digest of what the last push's loaders wrote into it}, for the content check."""
        if not self.layouts.mapped:
            return {}
        return {
            t: d for t, d in expected_digests(self.layouts).items() if t.split("#")[0] not in self.unwritten
        }

    def sources(self, llm) -> dict[str, list[str]]:
        """{vLLM tensor hashed: the learner tensors it is built from}, as the pushes so far recorded them."""
        held = set(self.held(llm))
        return {e: src for e, src in engine_sources(self.loads, self.origins).items() if e in held}
