"""Keep the learner's transformers model class as transformers wrote it while a colocated vLLM engine is built.

vLLM 0.32 runs the families it has no model of its own for (OLMo 2, OLMo 3, SmolLM3, Phi-2, Starcoder2,
GPT-NeoX, GLM, ...) through its Transformers backend, which decorates the transformers decoder class itself
for torch.compile (`support_torch_compile`: a new base class, `__init__` and `__call__`). In the colocated
mode the learner's model is an instance of that same class in the same process, created without the
decorated `__init__`'s attributes: its first forward fails (`'Olmo2Model' object has no attribute
'do_not_compile'`). `TransformersClassesRestored` snapshots every class of the model's transformers module
before the engine is built and puts back what building changed.

Restoring is exact for the engine too when vLLM does not compile that model (eager mode, the CPU default: the
decorated `__call__` then only forwards to `forward`). When it does compile it, the engine's model needs the
decorated class and the learner needs the plain one in the same process: that is refused, naming the ways out
(rollout.engine_kwargs.enforce_eager=true, or trainer.mode=async, where the engine has its own process).
"""

from __future__ import annotations

import sys


def _snapshot(module) -> dict[type, tuple[tuple, dict]]:
    return {
        obj: (obj.__bases__, dict(obj.__dict__))
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    }


class TransformersClassesRestored:
    """Context manager around building a vLLM engine for the transformers model class `model_class`."""

    def __init__(self, model_class: type):
        self.module = sys.modules[model_class.__module__]
        self.changed: list[str] = []

    def __enter__(self):
        self.before = _snapshot(self.module)
        return self

    def __exit__(self, *exc) -> None:
        for cls, (bases, attrs) in self.before.items():
            if cls.__bases__ == bases and dict(cls.__dict__) == attrs:
                continue
            self.changed.append(cls.__name__)
            if cls.__bases__ != bases:
                cls.__bases__ = bases
            for name in set(cls.__dict__) - set(attrs):
                delattr(cls, name)
            for name, value in attrs.items():
                if name not in ("__dict__", "__weakref__") and cls.__dict__.get(name) is not value:
                    setattr(cls, name, value)

    def check_compiled(self, compiled: bool) -> None:
        """After the build: refuse when vLLM compiles a model whose class it had decorated (see the module
        docstring)."""
        if self.changed and compiled:
            raise RuntimeError(
                f"rollout.engine=vllm: vLLM runs this model through its Transformers backend and compiles it, "
                f"which needs the transformers classes {self.changed} decorated in this process, where the "
                "learner's model is an instance of the plain class. Build the engine in eager mode "
                "(rollout.engine_kwargs.enforce_eager=true) or give it its own process (trainer.mode=async)"
            )
