"""Building a colocated vLLM engine leaves the learner's transformers class as transformers wrote it:
vLLM's Transformers backend decorates the decoder class itself for torch.compile (a new base class, a new
`__init__` and `__call__`), and the learner's model, an instance of that class made before, then fails at its
first forward. Here the decoration is done by hand on a class of a stand-in module (the real one, vLLM on
OLMo 2: tests/rollout/test_families.py)."""

import sys
import types

import pytest

from rlkit.rollout.engines.vllm.classes import TransformersClassesRestored


class Compiled:
    """What vLLM adds as a base class."""


class Pretrained:
    """The transformers base class."""


@pytest.fixture
def module():
    mod = types.ModuleType("fake_modeling")

    class Model(Pretrained):
        def __init__(self):
            self.ready = True

        def __call__(self, x):
            return x + 1

    class Other:
        pass

    Model.__module__ = Other.__module__ = mod.__name__
    mod.Model, mod.Other = Model, Other
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _decorate(cls):  # as vLLM's support_torch_compile does
    cls.__bases__ = cls.__bases__ + (Compiled,)
    old_init = cls.__init__

    def __init__(self, *a, **k):
        old_init(self, *a, **k)
        self.do_not_compile = True

    def __call__(self, x):
        if self.do_not_compile:
            return x + 1
        raise AssertionError

    cls.__init__, cls.__call__ = __init__, __call__
    cls.added = 1


def test_the_class_comes_back_as_it_was_and_an_instance_made_before_still_runs(module):
    before = module.Model()
    init, call = module.Model.__init__, module.Model.__call__
    restored = TransformersClassesRestored(module.Model)
    with restored:
        _decorate(module.Model)
        with pytest.raises(AttributeError, match="do_not_compile"):
            before(1)  # what the learner met before the fix
    assert restored.changed == ["Model"]
    assert module.Model.__bases__ == (Pretrained,) and not hasattr(module.Model, "added")
    assert module.Model.__init__ is init and module.Model.__call__ is call
    assert before(1) == 2 and module.Model()(1) == 2
    restored.check_compiled(False)  # eager: the engine's instance ran the plain forward anyway


def test_a_compiled_engine_for_a_decorated_class_is_refused_naming_the_ways_out(module):
    restored = TransformersClassesRestored(module.Model)
    with restored:
        _decorate(module.Model)
    with pytest.raises(RuntimeError, match=r"\['Model'\].*enforce_eager=true.*trainer\.mode=async"):
        restored.check_compiled(True)


def test_nothing_changed_nothing_refused(module):
    restored = TransformersClassesRestored(module.Other)
    with restored:
        pass
    assert restored.changed == []
    restored.check_compiled(True)
