"""Keep the learner's transformers model class as transformers wrote it while a colocated vLLM engine is built.

vLLM 0.32 runs the families it has no model of its own for (OLMo 2, OLMo 3, SmolLM3, Phi-2, Starcoder2,
GPT-NeoX, GLM, ...) through its Transformers backend, which decorates the transformers decoder class itself
for torch.compile (`support_torch_compile`: a new base class, `__init__` and `__call__`). In the colocated
mode the learner's model is an instance of that same class in the same process, created without the
decorated `__init__`'s attributes: its first forward fails (`'Olmo2Model' object has no attribute
'do_not_compile'`). `TransformersClassesRestored` snapshots every class of the model's transformers module
before the engine is built and puts back what building changed.

Restoring is exact for the engine too when vLLM does not compile that model (eager mode, the CPU default: the
decorated `__call__` then only forwards to `forward`). When it does compile it (CUDA's default), the engine's
model needs the decorated class and the learner needs the plain one in the same process: that is refused,
naming the ways out (rollout.engine_kwargs.enforce_eager=true, or trainer.mode=async, where the engine has its
own process). The refusal is decided before the build, from the model's config and the engine's settings
(`compiled_transformers_backend`), so it costs nothing; an engine that is not colocated (an async rollout
worker: no learner model in its process) is neither refused nor restored: its compiled model keeps the
decorated class it needs.
"""

from __future__ import annotations

import sys

from rlkit.rollout.engines.vllm.platform import hf_config

REFUSAL = (
    "rollout.engine=vllm: vLLM runs this model ({arch}) through its Transformers backend and compiles it, which "
    "needs the transformers classes {classes} decorated in this process, where the learner's model is an "
    "instance of the plain class. Build the engine in eager mode (rollout.engine_kwargs.enforce_eager=true) or "
    "give it its own process (trainer.mode=async)"
)


def transformers_backend(architectures, model_impl: str = "auto") -> bool:
    """Whether vLLM 0.32 runs a model of these `architectures` (its config's) through its Transformers backend,
    as its registry resolves them (`_ModelRegistry.resolve_model_cls`): `model_impl="transformers"` asks for it;
    with "auto", the first architecture vLLM knows decides (its module is vLLM's `transformers` for the families
    vLLM has no model of its own for: OLMo 2/3, SmolLM3, Starcoder2, GPT-NeoX, Phi-2, GLM, ...), and one it
    does not know at all falls back to the backend when transformers has the class."""
    import transformers
    from vllm.model_executor.models import ModelRegistry

    if model_impl == "transformers":
        return True
    if model_impl != "auto" or not architectures:
        return False
    known = [ModelRegistry.models[a] for a in architectures if a in ModelRegistry.models]
    if not known:
        return getattr(transformers, architectures[0], None) is not None
    return getattr(known[0], "module_name", "").rsplit(".", 1)[-1] == "transformers"


def will_compile(enforce_eager: bool, compilation_config=None) -> bool:
    """Whether vLLM 0.32 compiles the model it builds with these settings: not in eager mode (which sets
    `CompilationMode.NONE`), unless `compilation_config` (vllm.LLM's keyword: a mode number, a dict with `mode`
    or `level`, or a CompilationConfig) asks for none (0) or stock torch.compile (1), which do not use the
    `support_torch_compile` decoration."""
    if enforce_eager:
        return False
    mode = compilation_config
    if isinstance(compilation_config, dict):
        mode = compilation_config.get("mode", compilation_config.get("level"))
    elif compilation_config is not None and not isinstance(compilation_config, (int, str)):
        mode = getattr(compilation_config, "mode", None)
    if mode is None:
        return True
    if isinstance(mode, str):
        return mode.upper() not in ("0", "1", "NONE", "STOCK_TORCH_COMPILE")
    return int(mode) not in (0, 1)


def compiled_transformers_backend(config, *, enforce_eager: bool, llm_kwargs: dict) -> str | None:
    """The refusal of a colocated engine, or None: vLLM would run the model of HF `config` through its
    Transformers backend and compile it (see the module docstring). Decided before the build."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not transformers_backend(architectures, llm_kwargs.get("model_impl", "auto")):
        return None
    if not will_compile(enforce_eager, llm_kwargs.get("compilation_config")):
        return None
    return REFUSAL.format(arch=", ".join(architectures) or "?", classes="of its module")


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
        """After the build of a colocated engine: refuse when vLLM compiles a model whose class it had decorated (a
        backstop: `compiled_transformers_backend` refuses it before the build)."""
        if self.changed and compiled:
            raise RuntimeError(REFUSAL.format(arch=self.module.__name__, classes=self.changed))


def colocated_refusal(model_path: str, engine_kwargs: dict) -> str | None:
    """The start-up form of the build's refusal (vllm.classes.compiled_transformers_backend) for a colocated
    engine of `model_path` with `engine_kwargs`, before any model loads: None where it builds, or where the
    model's config cannot be read here (the build decides then)."""
    from vllm.platforms import current_platform

    eager = engine_kwargs.get("enforce_eager")
    try:
        config = hf_config(model_path)
    except Exception:  # a hub id without network, a path the data checks report: the build checks again
        return None
    eager = current_platform.is_cpu() if eager is None else eager
    return compiled_transformers_backend(config, enforce_eager=eager, llm_kwargs=engine_kwargs)
