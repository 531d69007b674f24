"""The garbage collector during a process's set-up.

A process of rlkit imports torch, transformers and often vLLM (millions of objects) before its loop starts.
While the heap grows, Python's automatic full collections scan all of it again each time it has grown by a
quarter: 8 full collections, ~1.3 s of CPU, in a rollout worker's start-up on 2 cores, the same in the trainer's
process (measured with a `gc.callbacks` timer, 2026-11-27). `setup_phase` runs a set-up (imports, checks, models,
engines) without automatic collections; the first automatic collection after it (at most one full one) frees
whatever garbage the set-up left: 3 full collections, ~0.2 s, in the same worker.

Explicit `gc.collect()` calls still run inside it: vLLM's before it measures free GPU memory and the engine
build's own (`older_objects_frozen`), so garbage that holds GPU memory is freed where it is counted.

`older_objects_frozen`, around a vLLM engine build (rlkit/rollout/engines/vllm/engine.py), keeps the build's own full
collections from rescanning the process that existed before it; `one_collection_after`, around its close, runs
one full collection where vLLM's shutdown and rlkit ran three, but only for an engine without sleep mode: vLLM's
CuMem allocator (sleep mode, CUDA) needs its shutdown's own `gc.collect()` (issue 61, item 4).
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def setup_phase():
    """The block runs without automatic garbage collection; the collector's on/off state is restored when it
    ends, returning or raising."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def older_objects_frozen():
    """Around an engine build: one full garbage collection, then every object that exists is frozen (`gc.freeze`),
    so the three full collections vLLM runs while it builds (after loading the weights, after processing them,
    before freezing the heap for serving) scan only what the build makes: each scanned the whole process,
    ~0.7 s with torch, transformers and vLLM imported (2 cores), more in a process that has run for a while.
    vLLM freezes the heap itself when the build is done and unfreezes it at shutdown; a failed build
    unfreezes here."""
    gc.collect()
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


@contextlib.contextmanager
def one_collection_after():
    """Around dropping a vLLM engine (`VLLMEngine.close`): the block's `gc.collect()` calls do nothing, and one
    full collection runs when it ends. vLLM's shutdown unfreezes the heap and runs two full collections, each
    walking the whole process (~0.7 s with torch, transformers and vLLM imported, more in a process that has
    run for a while); they ran while the engine was still being dropped, so a third one after it freed what
    its reference cycles held. The one after the drop frees all of it.

    Never around an engine with sleep mode: vLLM's CuMem teardown (`release_pools`) collects before it drops the
    allocator wrappers, so that no pool tensor is freed through a freed allocator (torch #145168)."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect
        gc.collect()


__all__ = ["older_objects_frozen", "one_collection_after", "setup_phase"]
