"""The typed configuration schema: one dataclass per config group, a docstring per field.

Hydra composes `configs/config.yaml` (+ a recipe from `recipes/` + command-line overrides) on top of
`RLConfig`. This module imports no other rlkit module: the valid names of a key come from the registry of
the module that implements it, and rlkit/config/rules.py with each component's `check_config` reject a
configuration that cannot work before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

# The source checkout (tests launch from it); an installed wheel has none.
REPO_ROOT = Path(__file__).resolve().parents[2]


def config_dirs() -> tuple[Path, Path]:
    """Hydra's config dir and the recipes dir, from the rlkit that is imported.

    A wheel ships them inside the package (`rlkit/configs`, `rlkit/recipes`: setup.py and pyproject's
    package-dir); an editable install or PYTHONPATH imports rlkit from a checkout, whose top-level
    `configs/` and `recipes/` sit beside the package.
    """
    package = Path(str(files("rlkit")))
    for root in (package, package.parent):
        if (root / "configs" / "config.yaml").is_file():
            return root / "configs", root / "recipes"
    raise FileNotFoundError(f"rlkit's configs/config.yaml is neither in {package} nor in {package.parent}")


CONFIG_DIR, RECIPE_DIR = config_dirs()

# The schema's default problem kinds of the generated arithmetic set (rlkit/data/arithmetic.py lists them all).
DEFAULT_ARITHMETIC_KINDS = ("plain_add", "story_add", "story_sub")


# Every attention and MLP projection of Llama-style models (peft `target_modules`).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank (peft): 0 trains every weight; > 0 trains low-rank adapters only, the base weights stay
    frozen in the compute dtype, the reference is the base (adapters off) and engines get merged weights."""
    alpha: float = 32.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """Names of the linear layers that get adapters (peft `target_modules`)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Hub id, local HF checkpoint dir, or a short name resolved by rlkit.models (e.g. `smollm2-135m`)."""
    dtype: str = "bfloat16"
    """auto | float32 | bfloat16: the rollout engine's weights and compute (the learner pushes its weights cast to
    it), and the learner's compute when model.compute_dtype is null (bf16 on CUDA or under FSDP2). The
    learner's weights, gradients and optimizer state are fp32 whatever it is (with LoRA the frozen base is in
    the compute dtype). float16 is not supported: it needs loss scaling, which the learner does not do. auto =
    bfloat16 where the hardware computes it natively (a CUDA GPU with bf16; a CPU with AVX512_BF16, AMX or
    aarch64 BF16 in /proc/cpuinfo), else float32 (emulated bf16 ran ~5x slower than fp32 on an AVX-512 Xeon
    without it); the run's config.json records the choice."""
    compute_dtype: Optional[str] = None
    """Learner compute: null = bf16 on CUDA or under FSDP2 when model.dtype=bfloat16, else fp32; bfloat16 =
    bf16 matmuls (autocast, or FSDP2's mixed precision) with fp32 master weights, gradients and optimizer
    state, on CPU too; float32; auto = as model.dtype (after its own auto is resolved)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    freeze_vision: bool = True
    """Vision-language models: the vision tower (its encoder and merger) is frozen, as TRL and verl do; the
    projector and the language model train. false trains the vision tower too. Ignored for text models."""
    freeze_language: bool = False
    """Vision-language runs with images (data.image_key): the language model (its decoder, embeddings and output
    head) is frozen, so only the vision side trains: the projector, and the vision tower too with
    model.freeze_vision=false. The warm-up of a vision side on pictures (recipes/sft_see.yaml); not with LoRA."""


@dataclass
class DataConfig:
    path: str = "openai/gsm8k"
    """Hub dataset id, a local JSON/JSONL/Parquet file, a directory with train.* / test.* files,
    `arithmetic` (a small GSM8K-format word-problem set generated offline by rlkit.data), `pictures` (small
    pictures of shapes drawn offline by rlkit.data, column `image`, for vision-language models), `reasoning_gym`
    (the tasks of `data.tasks`, generated offline by reasoning-gym), or `env` (the rows of the environment
    env.name, e.g. a verifiers taskset; data.eval_size of them held out for eval)."""
    subset: Optional[str] = "main"
    """Hub dataset configuration name (e.g. gsm8k's `main`); null for none."""
    train_split: str = "train"
    """Split used for training."""
    eval_split: Optional[str] = "test"
    """Held-out split for eval; when the dataset has no such split, `eval_size` rows are held out of train."""
    eval_size: int = 128
    """Number of eval prompts (taken from the eval split, or held out of train when there is none)."""
    prompt_key: str = "question"
    """Column holding the problem text."""
    answer_key: str = "answer"
    """Column holding the reference answer (GSM8K style: final answer after `####`)."""
    template: str = "chat"
    """`chat` (the tokenizer's chat template) or `plain` (`Question: ...\\nAnswer:`)."""
    system_prompt: Optional[str] = None
    """Optional system message for the chat template; `reasoning_gym:<name>` is reasoning-gym's system prompt
    <name> (`default`, `direct`, ...: its answer-tag instruction)."""
    instruction: str = "Solve the problem step by step. Write the final answer after '####'."
    """Appended to every question."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (in tokens, after templating) are dropped, with a logged count."""
    image_key: Optional[str] = None
    """Column holding each row's image(s) for a vision-language model: a path, bytes, a PIL image or a `datasets`
    Image feature, or a list of them. null = text only. The model's processor renders the prompt with one image
    placeholder per image (at each `<image>` in the question, else before it); image tokens count in
    data.max_prompt_tokens."""
    max_image_pixels: int = 4194304
    """Largest image (width x height, as decoded) a row may carry; a bigger one is a start-up error naming the row
    (or resized, with data.resize_images)."""
    resize_images: bool = False
    """Resize images over data.max_image_pixels down to it (aspect kept) instead of refusing them."""
    num_train: int = 2000
    """`arithmetic`, `pictures` and `reasoning_gym`: number of generated training problems."""
    num_eval: int = 200
    """`arithmetic`, `pictures` and `reasoning_gym`: number of generated eval problems."""
    arithmetic_kinds: list[str] = field(default_factory=lambda: list(DEFAULT_ARITHMETIC_KINDS))
    """`arithmetic` only: problem types, a subset of plain_add ("What is a + b?"), story_add, story_sub,
    plain_mul ("What is a * b?", 3-digit a, b), plain_add2 ("What is a + b?", 2-digit a, b), plain_add3
    ("What is a + b + c?"), story_two_step (gets b more, then gives away c); the last four are not in the
    default."""
    picture_kinds: list[str] = field(default_factory=lambda: ["count"])
    """`pictures` only: the picture tasks, a subset of count ("How many shapes are in the picture?", 1 to 4,
    the `math` reward) and colour ("What colour is the shape?", red / green / blue / yellow, the `exact`
    reward)."""
    tasks: Any = None
    """`reasoning_gym` only: the reasoning-gym tasks, a list of names (`[chain_sum, leg_counting]`) or a mapping
    from a name to its reasoning-gym config and an optional sampling `weight` (`{chain_sum: {max_terms: 3,
    weight: 2}}`); `num_train` / `num_eval` rows are generated (rlkit/data/reasoning_gym.py)."""


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """auto (vLLM where it imports and can run the model, CUDA or CPU, else HF) | hf | vllm."""
    group_size: int = 8
    """G: completions sampled per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off); the learner scores the same truncated, renormalised distribution."""
    top_k: int = 0
    """Top-k sampling (0 = off); the learner scores the same truncated, renormalised distribution."""
    max_new_tokens: int = 512
    """Response length cap; longer responses are clipped (finish reason `length`)."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings besides EOS."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens tokens, never stopping at EOS or a stop string (throughput benchmarks);
    training rollouts only, evaluation still stops."""
    return_logprobs: bool = True
    """Keep the engine's per-token log-probs (needed by rollout IS / rollout-KL / mismatch metrics)."""
    seed_per_prompt: bool = False
    """One generate call per prompt, seeded by (seed, step, prompt position in the global batch): the
    samples no longer depend on how prompts are batched or split over ranks (slower; for reproducibility)."""
    mismatch_samples: int = 0
    """Samples per rank the learner re-scores for the mismatch metrics when nothing else needs the
    current policy's log-probs of the whole batch (no rollout IS, on-policy update, no reference KL, no
    critic); 0 = all. A few samples suffice to prove the weight push and save a full forward pass."""
    verify_push: bool = True
    """After every weight push, check by content that the engine holds what the learner pushed (digests computed
    on the device as the export streams, one export per push: HF tensor for tensor; vLLM: what its push received,
    and every engine tensor at the positions its weight loaders write, a CPU-repacked linear read back from its
    kernel; tensors vLLM's processing changes after loading are checked by change) and probe the engine's
    log-probs against the learner's (vLLM: on fixed tokens spread over the vocabulary at start-up, before an
    evaluation and in async workers; on the next batch's own tokens otherwise, rlkit/sync.py); a mismatch is a
    WeightSyncError naming the tensors. In async mode each rollout worker checks its engine against the
    digests and probe of what the learner sent. What it compares and cannot see: docs/guides/operations.md."""
    weight_sync_kl_threshold: Optional[float] = None
    """At step 0 and after the first weight push, |mismatch/kl| above this is a fatal weight-sync error; null = 0.05
    when the learner and the engine compute in fp32, 0.15 with bf16 compute or bf16 weights (measured: docs/benchmarks.md)."""
    accept_engine_gap: Optional[float] = None
    """The mean |dlogp| between the engine's and the learner's log-probs on the weight-sync probe's fixed tokens
    (rlkit.verify.probe_gap, run at start-up on the engine as loaded and after every push) that this run
    accepts above the bound of its compute dtype and platform (fp32: 1e-4 on the CPU, 0.03 on CUDA;
    rlkit.verify.PROBE_BOUND). null = none: an engine whose forward differs
    from the learner's for this model (e.g. vLLM's CPU MLA attention of DeepSeek-V2/V3: 2.5e-3 and 2.2e-3 on
    the tiny test models) is refused at start-up with the measured gap; set this to at least that gap to train
    with it anyway (docs/supported-models.md)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the engine constructor."""
    eval_group_size: int = 1
    """k: samples per eval prompt; pass@k is reported when k > 1."""
    eval_temperature: float = 0.0
    """Eval sampling temperature (0 = greedy; use > 0 with eval_group_size > 1)."""


@dataclass
class RolloutISConfig:
    enabled: Optional[bool] = None
    """Multiply the policy loss by importance weights learner/engine (rollout correction); null = on with trainer.mode=async, else off."""
    level: str = "token"
    """token | sequence | geometric."""
    mode: str = "truncate"
    """truncate (cap at `upper`) | mask (drop outside [lower, upper]) | both."""
    upper: float = 2.0
    """Upper threshold of the IS weight."""
    lower: Optional[float] = None
    """Lower threshold (mask modes; default 1/upper)."""
    veto_lower: Optional[float] = None
    """Drop a whole sequence when any token's ratio is below this."""
    veto_upper: Optional[float] = None
    """Drop a whole sequence when any token's ratio is above this."""


@dataclass
class TeacherConfig:
    path: Optional[str] = None
    """On-policy distillation's teacher: any model model.path accepts (hub id, local dir, smollm2-135m, a
    checkpoint's model/ dir); its tokenizer must equal the policy's. Loaded only when algo.distill_coef > 0."""
    dtype: str = "auto"
    """auto (the learner's compute dtype, like the reference model) | float32 | bfloat16."""


@dataclass
class AlgoConfig:
    name: str = "grpo"
    """Label for logs only (grpo, dr_grpo, ppo, ...)."""
    adv_estimator: str = "grpo"
    """grpo | rloo | reinforce_pp | gae (PPO with a value model)."""
    norm_by_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    mask_zero_std_groups: bool = True
    """Remove groups whose rewards are all equal from the training loss (never in eval; not with distillation,
    whose term is informative in every group)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip | gspo | cispo | nll (supervised fine-tuning's -log p of the batch's tokens: python -m rlkit.sft)."""
    clip_low: float = 0.2
    """Lower clip range of the ratio (1 - clip_low)."""
    clip_high: float = 0.2
    """Upper clip range of the ratio (1 + clip_high)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (null = off)."""
    routing_replay: bool = False
    """Mixture-of-experts: the learner's routers use the experts the rollout engine routed each token to (Rollout Routing Replay; weights from the learner's router, so it still trains). vLLM with Model Runner V2 (CUDA); Qwen3-MoE and Mixtral."""
    max_token_staleness: Optional[int] = None
    """Tokens sampled more than this many policy versions before the step that trains them leave the loss (null = keep all; async, mostly with trainer.inflight_updates)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    norm_len: Optional[int] = None
    """Constant length of seq-mean-token-sum-norm (default rollout.max_new_tokens)."""
    kl_coef: float = 0.0
    """Coefficient of the KL to the reference model (0 = no reference model loaded)."""
    kl_estimator: str = "k3"
    """k1 | abs | k2 | k3."""
    kl_in_reward: bool = False
    """PPO: put -kl_coef * KL into the token rewards (kl_shaped_rewards) instead of the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    gamma: float = 1.0
    """Discount (reinforce_pp, gae)."""
    lam: float = 1.0
    """GAE lambda."""
    value_model: bool = False
    """Train a value model (PPO critic); required by adv_estimator=gae."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    value_clip: Optional[float] = 0.2
    """Value clipping range (null = off)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (> 1 makes later mini-batches off-policy)."""
    rollout_is: RolloutISConfig = field(default_factory=RolloutISConfig)
    """Rollout importance sampling (engine/learner mismatch correction)."""
    rollout_kl_coef: float = 0.0
    """Coefficient of the KL between learner and engine log-probs (soft trust region; 0 = off)."""
    rollout_kl_estimator: str = "k2"
    """k1 | abs | k2 | k3 for the rollout-KL term."""
    dynamic_sampling: str = "off"
    """off | refill: drop groups whose `filter_metric` has no spread and generate more prompts until the
    step holds train_batch_size samples of informative groups (DAPO dynamic sampling)."""
    filter_metric: str = "reward"
    """Spread that makes a group informative under refill: reward (the total reward) | accuracy (the task's
    verdict of correct, see reward.correct_threshold)."""
    max_gen_batches: int = 4
    """Refill: at most this many generation batches per step; then train on what there is (warning)."""
    overlong_filter: bool = False
    """Take responses cut by rollout.max_new_tokens (finish reason `length`) out of the loss mask."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation's teacher model (algo.distill_coef > 0)."""
    distill_coef: float = 0.0
    """On-policy distillation: per-token advantage = task_coef x task advantage + distill_coef x
    -(log p_policy - log p_teacher) of each sampled token (rlkit/algos/distill.py; 0 = off, no teacher loaded)."""
    distill_gamma: float = 0.0
    """Discount of the distillation term over later tokens: 0 = each token's own reverse KL (the default), 1 =
    the sum of the rest of the response's (the sequence-level reverse KL's score-function gradient)."""
    task_coef: float = 1.0
    """Weight of the task reward's advantage (0 with distill_coef > 0 = pure distillation; rewards are still
    scored, logged and used by the evaluation)."""


@dataclass
class RewardConfig:
    fn: str = "math"
    """Main reward: a registered name (`math`, `format`, `reasoning_gym`, `answer_tags`, `exact`) or an import path `module:fn` / `module.fn`
    called as fn(prompt, response, answer, **columns) -> float (see the reward guide in the docs)."""
    correct_threshold: float = 1.0
    """A sample is correct (accuracy, eval/pass@k, filter_metric=accuracy) when its main reward is at least
    this, unless the function declares its own verdict (@rlkit.rewards.correct_when)."""
    extra: dict[str, float] = field(default_factory=dict)
    """More reward functions with their weights, added to `fn` (e.g. `+reward.extra.format=0.1`)."""
    timeout_s: float = 10.0
    """A reward call running longer than this yields 0 and counts in `reward/errors`."""
    num_workers: int = 2
    """Reward worker processes (isolated so a hanging function can be killed)."""
    batch_timeout_s: float = 60.0
    """Limit of one call of a batched reward function (@rlkit.rewards.batched); over it the batch scores 0."""
    memory_limit_mb: Optional[int] = 8192
    """Memory cap of each reward worker process (RLIMIT_DATA: heap and anonymous memory, on top of what the
    worker holds at its start); a function over it scores 0 (`reward/errors`); null = no cap. Where a memory
    cgroup is writable, the worker and all it starts (shared memory included) are also held to it by the kernel.
    Workers also get oom_score_adj 1000 (see docs/guides/operations.md)."""
    max_processes: Optional[int] = 8192
    """Most processes and threads of the reward workers and all they start (a pids cgroup, where one is
    writable: see docs/guides/operations.md); null = no cap."""
    max_failed_steps: int = 3
    """Stop the run when a reward function fails on every sample of this many steps in a row (0 = never);
    one failing on more than half a step's samples is warned about once per cause (docs/guides/operations.md)."""
    route_by: Optional[str] = None
    """A dataset column (e.g. data_source) whose value picks each sample's main reward from `routes`."""
    routes: dict[str, str] = field(default_factory=dict)
    """Column value -> reward function (name or import path); other values use `fn`."""
    model: Optional[str] = None
    """A sequence-classification reward model (hub id or local dir, one output) scoring each response in
    the conversation the policy saw; null = none."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the total reward (logged as `reward/model`)."""
    model_batch_size: int = 16
    """Sequences per reward-model forward pass."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: the last this many tokens before rollout.max_new_tokens (0 = off)."""
    overlong_penalty: float = 1.0
    """Penalty at the cap; it grows linearly over the buffer and is logged as `reward/overlong`."""


@dataclass
class EnvConfig:
    name: str = "single_turn"
    """Episode environment: single_turn (the dataset's task) | calculator | an import path module:Class |
    verifiers:ID (an installed verifiers environment, by its taskset id) | openenv:URL (an OpenEnv server)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (one environment per episode); for verifiers:ID and
    openenv:URL, the adapter's options (docs/guides/ecosystem.md)."""
    max_turns: int = 4
    """An episode ends after this many model turns."""
    max_total_tokens: Optional[int] = None
    """Cap on an episode's response tokens, model and observation (finish `length`); null = rollout.max_new_tokens."""
    timeout_s: float = 10.0
    """An environment reset or step running longer than this is killed (its worker process) and ends its episode with reward 0 (`env/timeouts`)."""
    startup_timeout_s: float = 300.0
    """Limit of reading an environment's dataset (`rows`, data.path=env) in a worker at start-up; over it the
    worker is killed and the run stops before any model loads, naming env.name."""
    memory_limit_mb: Optional[int] = 8192
    """Memory cap of each process of an environment worker (RLIMIT_DATA: heap, anonymous memory and thread
    stacks, reserved rather than touched, on top of what the worker holds at its start); an allocation over it
    fails that episode (`env/errors`); null = no cap. Where a memory cgroup is writable, the worker and all it
    starts (shared memory and /dev/shm files included) are also held to it by the kernel. Workers also get
    oom_score_adj 1000 (see docs/guides/operations.md)."""
    max_processes: Optional[int] = 8192
    """Most processes and threads of one batch's environment workers and all they start (a pids cgroup, or
    a count of processes in /proc where none is writable: see docs/guides/operations.md); null = no cap."""
    max_failed_steps: int = 3
    """Stop the run when every episode fails (env/errors) in this many steps in a row (0 = never)."""


@dataclass
class TrainerConfig:
    steps: int = 100
    """Number of training steps (one rollout batch + update each)."""
    train_batch_size: int = 64
    """Samples per step over all ranks (prompts x group_size)."""
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas: two values in [0, 1)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: str = "constant"
    """constant | cosine (after warm-up)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (> 0; `inf` = no clipping, the norm is still logged)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget (prompt + response) per learner micro-batch; real tokens when pack_sequences, else padded."""
    pack_sequences: bool = False
    """Learner runs each micro-batch as one padding-free sequence (attention kept inside each row); off: slower on CPU sdpa (docs/concepts/training-step.md). Turned off at start-up (one INFO line) for a model where a packed row would not score as alone: layers with state across positions (hybrids), or an attention path that misses the row restarts (measured on the model)."""
    logprob_chunk_tokens: int = 512
    """Positions per chunk through the LM head for log-probs / entropy (memory ~ chunk x vocab); 0 = full logits."""
    seed: int = 0
    """Seed for data order, sampling and model init."""
    eval_every: int = 0
    """Evaluate every this many steps (0 = only at the end)."""
    eval_at_start: bool = True
    """Also evaluate before the first step (the baseline the run is judged against)."""
    save_every: int = 0
    """Checkpoint every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep only this many most recent checkpoints (0 = keep all)."""
    max_nonfinite_steps: int = 3
    """Stop the run with an error after this many optimizer steps in a row skipped for a non-finite loss or gradient norm."""
    resume: str = "auto"
    """auto (the newest checkpoint in run_dir that verifies, if any) | none | a checkpoint directory."""
    run_dir: str = "runs/${logger.name}"
    """Where metrics.jsonl, checkpoints and the W&B run go."""
    num_processes: Optional[int] = None
    """Processes to start (null = one per visible GPU, or the most the batch splits over; 1 on CPU); >1 on CPU uses gloo."""
    device: str = "auto"
    """auto | cpu | cuda (cpu keeps the learner on the CPU on a machine with GPUs too)."""
    strategy: str = "auto"
    """Learner wrapper with several processes: auto (FSDP2 on CUDA, DDP on CPU) | fsdp2 | ddp (FSDP2 runs on CPU over gloo too)."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""
    curves: bool = True
    """Draw `<run_dir>/curves.png` from metrics.jsonl at the end of the run (rank 0; matplotlib, about 2 s);
    `scripts/plot_run.py RUN_DIR` draws it later either way."""
    compile: bool = False
    """torch.compile the policy's forward (dynamic shapes; `learner/compiled_graphs` counts the graphs);
    off by default: on the CPU quickstart compiling took 6.5 min and the update ran no faster after it
    (docs/benchmarks.md, The compiled learner)."""
    compile_backend: str = "inductor"
    """inductor (C++ on CPU, Triton on CUDA) | aot_eager | eager (the last two: debugging)."""
    reuse_update_forward: bool = True
    """Take the learner's pre-update log-probs (rollout IS weights, mismatch metrics) from the update's own
    first forward instead of a separate scoring pass, where that gives the same numbers: one optimizer step
    per batch, no reference, critic or teacher, no IS rejection or veto, no dropout. false = always the
    separate pass (rlkit/learner/reuse.py)."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for perf/learner_mfu and perf/gen_mfu; null = the datasheet's dense bf16
    figure on CUDA (a table by device name); on CPU a matmul benchmark at the compute dtype, the best of 5 short
    runs (once a day) and of the figures cached for this machine ($RLKIT_CACHE/cpu_peak.json); raised (with a
    warning) when a phase runs faster than it, so MFU never exceeds 1."""
    collective_timeout_s: float = 600.0
    """With several processes: a collective that waits longer than this (a rank hung, stopped or dead) ends
    every rank with an error naming the rank that stopped."""
    mode: str = "sync"
    """sync (generate, then train, on every rank) | async (rollout worker processes generate while the learner trains; rlkit/rollout/remote/)."""
    max_staleness: int = 1
    """async: the batch of step s is generated by the policy of step s - max_staleness (0 = the sync schedule, 1 = one-step-off-policy)."""
    rollout_gpus: int = 1
    """async: rollout worker processes, one GPU each (the last GPUs; the learner trains on the others), or CPU processes without a GPU."""
    log_samples: int = 0
    """Samples written to <run_dir>/samples.jsonl and a W&B table per training step and per evaluation (prompt,
    response, reward and its parts, correct, finish reason, length, step; the first rows of rank 0); 0 = none."""
    inflight_updates: str = "off"
    """async + vLLM: a worker takes new weights between two engine steps, mid-batch (partial rollouts). "off": only between batches; "recompute": running requests recompute their KV under the new weights; "keep_kv": they keep the old weights' KV (later requests get a fresh cache salt). Needs algo.rollout_is.enabled. See docs/concepts/async.md."""


@dataclass
class EvalConfig:
    """`python -m rlkit.eval` (and the statistics of training's periodic evaluation: eval.ks, eval.task_key)."""

    model: Optional[str] = None
    """rlkit.eval: what to evaluate: a checkpoint (checkpoints/step_<k> or its model/), an HF model folder, a
    peft LoRA adapter folder (merged onto its base: eval.base or the adapter's base_model_name_or_path), a hub
    id or a short name; null = model.path."""
    base: Optional[str] = None
    """rlkit.eval with a LoRA adapter: its base model (null = the adapter's own base_model_name_or_path)."""
    n: Optional[int] = None
    """rlkit.eval: samples per prompt; null = rollout.eval_group_size (what training's evaluation draws)."""
    temperature: Optional[float] = None
    """rlkit.eval: sampling temperature, 0 = greedy; null = rollout.eval_temperature."""
    ks: list[int] = field(default_factory=list)
    """pass@k and maj@k for these k (each <= the samples per prompt: a larger one is a start-up error); empty =
    1 and the samples per prompt. In training too (eval/pass@<k>, eval/maj@<k>)."""
    seeds: list[int] = field(default_factory=list)
    """rlkit.eval: one evaluation per sampling seed (mean and spread over seeds); empty = [trainer.seed],
    which draws what training's evaluation draws."""
    task_key: str = "task"
    """A dataset column naming each prompt's task: one row per task in the table (eval/pass@1/<task> in
    training) plus the total; absent column = the total only."""
    output: Optional[str] = None
    """rlkit.eval: the eval.json to write (checked writable at start-up); null = eval.json in Hydra's output dir
    (outputs/eval/<date>/<time>)."""


@dataclass
class SFTConfig:
    """`python -m rlkit.sft`: supervised fine-tuning rows, their length budget and the run length (rlkit/data/sft.py)."""

    messages_key: str = "messages"
    """Column holding a chat (a list of {role, content} messages: system, user, assistant, tool); the loss is on
    every assistant turn. Rows without this column are prompt/completion pairs: data.prompt_key (templated as
    RL prompts are: data.system_prompt, data.instruction) and sft.completion_key (the assistant's answer)."""
    completion_key: Optional[str] = None
    """Column holding the completion of prompt/completion rows; null = data.answer_key (the arithmetic and
    GSM8K answers: the worked solution and `#### N`)."""
    max_length: int = 1024
    """Token budget of one row (template included); longer rows are handled as sft.overlong says, and counted."""
    overlong: str = "truncate"
    """truncate (keep the first sft.max_length tokens; a row left with no assistant token is dropped) | drop."""
    epochs: Optional[int] = None
    """Passes over the training rows: trainer.steps = ceil(epochs x rows / trainer.train_batch_size); null =
    trainer.steps as given."""
    generation_eval: bool = False
    """At every evaluation (trainer.eval_every, the start and the end) also generate on the held-out prompts and
    score them with the reward, as training's evaluation and `rlkit.eval` do (the same code path: `eval/pass@k`,
    `eval/reward_mean`, ...; rollout.engine samples rollout.eval_group_size per prompt at
    rollout.eval_temperature): the data must have prompts and answers (data.prompt_key, data.answer_key)."""


@dataclass
class LoggerConfig:
    backend: str = "wandb"
    """wandb | console | none (metrics.jsonl in the run dir is always written)."""
    project: str = "rlkit"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team); null = your default."""
    name: str = "run"
    """Run name (also names the run dir by default)."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


class ConfigError(ValueError):
    """A configuration that cannot work (raised before any model loads)."""


def register_configs() -> None:
    """Register the schema and every recipe with Hydra's ConfigStore.

    Recipes live in the top-level `recipes/` folder but must be addressed as `+recipe=NAME`; Hydra maps
    a group to a folder under the config dir, so we store each file under group `recipe` with package
    `_global_` instead. A recipe's own `defaults: [override /algo: ppo]` keeps working.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="rlkit_schema", node=RLConfig)
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def to_dict(cfg: RLConfig) -> dict:
    """Plain nested dict of the config (for W&B and the run dir)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
