"""What VLLMEngine does around `vllm.LLM` on CUDA, shown on CPU with a recorder in place of the engine
(CUDA-only behaviour found by reading the code): the memory plan of a colocated engine and of an async worker's, what the
engine's construction may leave in the process (vLLM's later-use variables) and what it must not (the
launcher's variables, LD_PRELOAD, every RNG state, the CUDA generator's included), and the model runner."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import types

import numpy as np
import pytest
import torch

from rlkit.rollout.engines import make_engine
from rlkit.rollout.engines.vllm import engine as vllm_engine
from rlkit.rollout.engines.vllm.memory import memory_plan

pytest.importorskip("vllm")

# What vLLM 0.32 sets while an engine is built and reads again later (vllm/config/vllm.py,
# vllm/compilation/decorators.py), and what it sets for its start-up only.
LATER_USE = {
    "VLLM_USE_BREAKABLE_CUDAGRAPH": "1",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/vllm-inductor",
    "NCCL_GRAPH_REGISTER": "0",
}
START_UP = {
    "RANK": "5",
    "LOCAL_RANK": "5",
    "WORLD_SIZE": "8",
    "MASTER_PORT": "1",
    "LD_PRELOAD": "/x/libgomp.so",
}


class FakeLLM:
    """Stands for vllm.LLM: records its keywords and does to the process what building an engine does."""

    built: list = []
    v2 = True

    def __init__(self, **kwargs):
        FakeLLM.built.append(kwargs)
        os.environ.update(LATER_USE | START_UP)
        random.seed(1), np.random.seed(1), torch.manual_seed(1)  # vLLM's set_random_seed
        torch.cuda.set_rng_state(torch.full((8,), 7, dtype=torch.uint8))  # current_platform.manual_seed_all
        from vllm.config import CompilationMode

        compilation = types.SimpleNamespace(mode=CompilationMode.NONE)  # eager: the model is not compiled
        config = types.SimpleNamespace(use_v2_model_runner=FakeLLM.v2, compilation_config=compilation)
        self.llm_engine = types.SimpleNamespace(
            vllm_config=config, model_config=types.SimpleNamespace(max_model_len=512),
            set_weight_version=lambda v: None,
        )  # fmt: skip


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA generator in use (the learner's device); its state is recorded wherever it is set."""
    state = {"now": torch.arange(8, dtype=torch.uint8), "set": []}

    def set_rng_state(s, device="cuda"):
        state["now"] = s.clone()
        state["set"].append(s.clone())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return state


@pytest.fixture
def fake_llm(monkeypatch):
    import vllm

    FakeLLM.built = []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    for key in (*LATER_USE, *START_UP, "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    return FakeLLM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("v"), hidden_size=128, num_layers=1)


def test_building_keeps_what_vllm_reads_later_and_restores_the_launchers_variables(
    fake_llm, fake_cuda, ckpt, monkeypatch
):
    monkeypatch.setenv("LD_PRELOAD", "/mine.so")
    monkeypatch.setenv("RANK", "0")
    vllm_engine.VLLMEngine(ckpt, dtype="float32", kv_cache_gib=0.25)
    assert len(fake_llm.built) == 1
    for key, value in LATER_USE.items():  # vLLM reads these again: they stay
        assert os.environ.get(key) == value, key
    assert os.environ["RANK"] == "0" and os.environ["LD_PRELOAD"] == "/mine.so"
    assert (
        "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ
    )


def test_building_restores_every_rng_state_the_cuda_generators_included(fake_llm, fake_cuda, ckpt):
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    before = (torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    cuda_before = fake_cuda["now"].clone()
    vllm_engine.VLLMEngine(ckpt, dtype="float32", kv_cache_gib=0.25)
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]
    assert torch.equal(fake_cuda["now"], cuda_before) and len(fake_cuda["set"]) == 2  # vLLM's, then ours


@pytest.mark.parametrize(("v2", "name"), [(True, "V2"), (False, "V1")])
def test_the_build_line_names_the_model_runner(fake_llm, fake_cuda, ckpt, caplog, v2, name):
    fake_llm.v2 = v2
    with caplog.at_level(logging.INFO, logger="rlkit.rollout.engines.vllm"):
        engine = vllm_engine.VLLMEngine(ckpt, dtype="float32", kv_cache_gib=0.25)
    assert engine.model_runner == name
    assert any(f"model runner {name}" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize(
    ("colocated", "share", "sleep"), [(True, 0.3, True), (False, 0.92, False)], ids=["colocated", "own-gpu"]
)
def test_an_engine_on_a_gpu_of_its_own_neither_sleeps_nor_leaves_the_gpu_empty(colocated, share, sleep):
    """0.92 stands for vLLM's own default here (the engine reads it from EngineArgs: the make_engine test)."""
    plan = functools.partial(memory_plan, vllm_default=0.92)
    assert plan(colocated, None, None, sleep_available=True) == (share, sleep)
    # An explicit choice wins; without sleep mode on the platform (CPU) there is none either way.
    assert plan(colocated, 0.5, True, sleep_available=True) == (0.5, True)
    assert plan(colocated, None, None, sleep_available=False)[1] is False


def test_an_async_worker_on_a_gpu_builds_its_engine_as_not_colocated(monkeypatch, ckpt):
    from rlkit.config.schema import RLConfig
    from rlkit.rollout.remote import worker

    made = []
    monkeypatch.setattr(worker, "LocalRollouts", lambda cfg, **kw: made.append(kw["colocated"]))
    monkeypatch.setattr(worker, "load_tokenizer", lambda path: None)
    cfg = RLConfig()
    cfg.model.dtype = "bfloat16"
    worker.worker_rollouts(cfg, 0, 2, torch.device("cuda", 0))
    worker.worker_rollouts(cfg, 0, 2, torch.device("cpu"))
    assert made == [False, True]


def test_make_engine_hands_the_colocation_to_the_vllm_engine(fake_llm, fake_cuda, ckpt):
    make_engine("vllm", ckpt, dtype="float32", colocated=False, kv_cache_gib=0.25)
    make_engine("vllm", ckpt, dtype="float32", kv_cache_gib=0.25)
    # On this (CPU) platform vLLM has no sleep mode; the share is what the plan gives each.
    assert [b["gpu_memory_utilization"] for b in fake_llm.built] == [0.92, 0.3]
    assert [b["enable_sleep_mode"] for b in fake_llm.built] == [False, False]


def test_make_engine_hands_the_run_tokenizer_to_the_vllm_engine(fake_llm, fake_cuda, ckpt):
    """The run's tokenizer is used, not loaded a second time (vLLM's own `tokenizer` keyword stays the path)."""
    from rlkit.models import load_tokenizer

    tok = load_tokenizer(ckpt)
    handed = make_engine("vllm", ckpt, dtype="float32", kv_cache_gib=0.25, tokenizer=tok)
    loaded = make_engine("vllm", ckpt, dtype="float32", kv_cache_gib=0.25)
    assert handed.tokenizer is tok and loaded.tokenizer is not tok
    assert loaded.tokenizer.get_vocab() == tok.get_vocab()
    assert [b["tokenizer"] for b in fake_llm.built] == [b["model"] for b in fake_llm.built]


# -- issue 61, item 1: a family on vLLM's Transformers backend, compiled (CUDA's default) ---------------------


class CompilingLLM(FakeLLM):
    """vllm.LLM for a model on vLLM's Transformers backend, as vLLM builds it on CUDA: unless eager, it decorates
    the transformers decoder class for torch.compile (support_torch_compile) and compiles."""

    decorated: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from transformers.models.olmo2 import modeling_olmo2
        from vllm.config import CompilationMode

        if not kwargs["enforce_eager"]:
            modeling_olmo2.Olmo2Model.rlkit_test_compiled = True  # what the decoration adds to the class
            CompilingLLM.decorated.append(modeling_olmo2.Olmo2Model)
        mode = CompilationMode.NONE if kwargs["enforce_eager"] else CompilationMode.VLLM_COMPILE
        self.llm_engine.vllm_config.compilation_config = types.SimpleNamespace(mode=mode)


@pytest.fixture
def compiling_llm(fake_llm, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", CompilingLLM)
    CompilingLLM.decorated = []
    yield CompilingLLM
    for cls in CompilingLLM.decorated:  # a build that was not restored leaves it: undo it here
        if "rlkit_test_compiled" in cls.__dict__:
            del cls.rlkit_test_compiled


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    from model_families import build_family

    return build_family("olmo2", tmp_path_factory.mktemp("olmo2"))


def test_an_async_worker_builds_a_compiled_transformers_backend_model_and_keeps_its_decorated_class(
    compiling_llm, olmo2
):
    """Not colocated (an async worker: no learner model in its process), nothing is refused and the class vLLM
    decorated stays decorated, as its compiled model needs (today's main refused it after the whole build)."""
    from transformers.models.olmo2 import modeling_olmo2

    engine = vllm_engine.VLLMEngine(
        olmo2, dtype="float32", kv_cache_gib=0.25, enforce_eager=False, colocated=False
    )
    assert len(compiling_llm.built) == 1 and engine.llm is not None
    assert modeling_olmo2.Olmo2Model.__dict__.get("rlkit_test_compiled") is True


def test_a_colocated_compiled_transformers_backend_model_is_refused_before_vllm_builds_anything(
    compiling_llm, olmo2
):
    with pytest.raises(RuntimeError, match=r"Olmo2ForCausalLM.*enforce_eager=true.*trainer\.mode=async"):
        vllm_engine.VLLMEngine(olmo2, dtype="float32", kv_cache_gib=0.25, enforce_eager=False)
    assert compiling_llm.built == []  # refused before vllm.LLM (no compile, no graph capture)


def test_a_colocated_eager_transformers_backend_model_builds_with_its_class_restored(compiling_llm, olmo2):
    from transformers.models.olmo2 import modeling_olmo2

    vllm_engine.VLLMEngine(olmo2, dtype="float32", kv_cache_gib=0.25, enforce_eager=True)
    assert len(compiling_llm.built) == 1 and "rlkit_test_compiled" not in modeling_olmo2.Olmo2Model.__dict__


def test_which_models_vllm_runs_on_its_transformers_backend_and_which_settings_compile():
    from rlkit.rollout.engines.vllm.classes import transformers_backend, will_compile

    for arch in ("Olmo2ForCausalLM", "GPTNeoXForCausalLM", "Starcoder2ForCausalLM", "PhiForCausalLM"):
        assert transformers_backend([arch]), arch
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"):
        assert not transformers_backend([arch]), arch
    assert transformers_backend(["LlamaForCausalLM"], "transformers")
    assert not transformers_backend(["Olmo2ForCausalLM"], "vllm")
    assert will_compile(False) and not will_compile(True)
    assert (
        not will_compile(False, 0)
        and not will_compile(False, {"mode": 1})
        and will_compile(False, {"level": 3})
    )
    assert not will_compile(False, "NONE") and will_compile(False, {"cudagraph_mode": "FULL"})


# -- issue 61, item 4: close() and vLLM's CuMem teardown ---------------------------------------------------------


class DroppedLLM:
    """Stands for vllm.LLM at its shutdown: vLLM's CuMem teardown (release_pools) calls gc.collect() before it
    drops the allocator wrappers; `state["in_teardown"]` is true during that call."""

    def __init__(self, state: dict):
        self.state = state

    def __del__(self):
        import gc

        self.state["in_teardown"] = True
        gc.collect()
        self.state["in_teardown"] = False


@pytest.mark.parametrize("sleep", [True, False], ids=["sleep-mode", "no-sleep-mode"])
def test_close_leaves_the_cumem_teardowns_collection_alone_with_sleep_mode(monkeypatch, sleep):
    """With sleep mode the teardown's own gc.collect() reaches the collector (the spy sees it inside the
    teardown); without, it is skipped and one full collection runs after the drop."""
    import gc

    state, seen = {"in_teardown": False}, []
    real = gc.collect

    def spy(generation=2):
        seen.append("in the teardown" if state["in_teardown"] else "after the drop")
        return real(generation)

    monkeypatch.setattr(gc, "collect", spy)
    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.sleep_enabled, engine._owns_dist, engine.llm = sleep, False, DroppedLLM(state)
    engine.close()
    assert engine.llm is None
    assert seen == (["in the teardown"] if sleep else ["after the drop"])


# -- issue 61, item 11: the push runs in vLLM's config context ------------------------------------------------


def test_worker_reload_runs_the_loaders_and_the_processing_in_vllms_config_context(monkeypatch):
    """As vLLM's own Worker.reload_weights: quantised loaders and post-load processing read the current config
    (vLLM 0.32's get_current_vllm_config asserts outside `set_current_vllm_config`)."""
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise

    from rlkit.rollout.engines.vllm import reload as vllm_reload
    from rlkit.rollout.engines.vllm.platform import contained_side_effects

    # Building a VllmConfig runs the CPU platform's check_and_update_config, which extends LD_PRELOAD with libgomp
    # and tcmalloc: undone as the engine undoes it, or every later test of this pytest worker inherits them
    # (test_vllm_engine.py's check that building an engine leaves LD_PRELOAD alone then failed after this one).
    with contained_side_effects():
        config = VllmConfig()
    seen = []

    def current(where):
        seen.append((where, get_current_vllm_config() is config))

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            for _ in weights:
                current("loader")

    model = Model()
    monkeypatch.setattr(layerwise, "initialize_layerwise_reload", lambda m: current("initialize"))
    monkeypatch.setattr(layerwise, "finalize_layerwise_reload", lambda m, mc: current("processing"))
    worker = types.SimpleNamespace(
        vllm_config=config, model_config=None, model_runner=types.SimpleNamespace(get_model=lambda: model)
    )
    report = vllm_reload.worker_reload(worker, iter([("w", torch.zeros(1))]))
    assert report["missed"] == [] and seen == [("initialize", True), ("loader", True), ("processing", True)]
    seen.clear()
    vllm_reload.worker_close_failed_reload(worker)
    assert seen == [("processing", True)]


# -- issue 61, item 8: sleep level 2 where a push comes before the next generation --------------------------------


class SleepRecorder:
    """Stands for vllm.LLM's sleep: records each level."""

    def __init__(self):
        self.levels = []

    def sleep(self, level):
        self.levels.append(level)


def _sleeping_engine(level=None):
    engine = object.__new__(vllm_engine.VLLMEngine)
    default = inspect.signature(vllm_engine.VLLMEngine.__init__).parameters["sleep_level"].default
    engine.sleep_enabled, engine.sleep_level = True, default if level is None else level
    engine._asleep = engine._weights_awake = engine._weights_lost = False
    engine.llm = SleepRecorder()
    return engine


def test_sleep_level_2_is_the_default_and_a_sleep_the_weights_must_outlast_is_level_1():
    """Level 1 copies every weight to pinned host memory and back every step only for the push to overwrite
    them; the training loop pushes before it generates again, so level 2 (drop them) is the default."""
    engine = _sleeping_engine()
    assert engine.sleep_level == 2
    engine.sleep()
    assert engine.llm.levels == [2] and engine._weights_lost  # generate now needs a push first
    engine._asleep = False
    engine.sleep(keep_weights=True)
    assert engine.llm.levels == [2, 1] and not engine._weights_lost
    chosen = _sleeping_engine(level=1)  # rollout.engine_kwargs.sleep_level=1 chooses offloading
    chosen.sleep()
    assert chosen.llm.levels == [1] and not chosen._weights_lost


def test_the_build_takes_the_default_and_the_choice(fake_llm, fake_cuda, ckpt):
    assert vllm_engine.VLLMEngine(ckpt, dtype="float32", kv_cache_gib=0.25).sleep_level == 2
    assert vllm_engine.VLLMEngine(ckpt, dtype="float32", kv_cache_gib=0.25, sleep_level=1).sleep_level == 1


class Stop(Exception):
    pass


@pytest.mark.parametrize(("dynamic", "keep"), [("off", False), ("refill", True)])
def test_the_producer_lets_the_engine_drop_its_weights_only_where_a_push_comes_next(dynamic, keep):
    """One generation per step (then the update and its push): the sleep may drop the weights. A refill's
    batches and an evaluation generate again before any push: their sleeps keep the weights."""
    from rlkit.rollout.producer import Producer

    sleeps = []
    producer = object.__new__(Producer)
    producer.engine = types.SimpleNamespace(
        wake=lambda: None, sleep=lambda keep_weights: sleeps.append(keep_weights)
    )
    producer._awake, producer._push_comes_next = False, False
    producer.cfg = types.SimpleNamespace(
        algo=types.SimpleNamespace(dynamic_sampling=dynamic, max_gen_batches=1)
    )
    producer.group_size, producer.prompts_per_rank, producer.world = 2, 1, 1

    def generate_and_score(step, batch, timers):
        with producer.awake():
            pass
        raise Stop

    producer._generate_and_score = generate_and_score
    with pytest.raises(Stop):
        producer.produce(0, None)
    with producer.awake():  # an evaluation, or anything else outside produce
        pass
    assert sleeps == [keep, True] and producer._push_comes_next is False


@pytest.mark.parametrize(
    ("mode", "eager", "refused"), [("sync", False, True), ("async", False, False), ("sync", True, False)]
)
def test_the_preflight_refuses_a_colocated_compiled_transformers_backend_family(olmo2, mode, eager, refused):
    """Before any model loads: sync mode (colocated), vLLM compiling (here asked for; CUDA's default) and a family
    on vLLM's Transformers backend; async (the engine in its own process) and eager mode pass."""
    from rlkit.config.schema import ConfigError, RLConfig
    from rlkit.rollout import engines

    cfg = RLConfig()
    cfg.model.path, cfg.rollout.engine, cfg.trainer.mode = olmo2, "vllm", mode
    cfg.rollout.engine_kwargs = {"enforce_eager": eager}
    if not refused:
        engines.check_config(cfg)
        return
    with pytest.raises(ConfigError, match=r"Olmo2ForCausalLM.*enforce_eager=true.*trainer\.mode=async"):
        engines.check_config(cfg)
