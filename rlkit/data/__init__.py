"""Data: loading (loading.py), prompts and their order (prompts.py), the generated arithmetic set
(arithmetic.py)."""
