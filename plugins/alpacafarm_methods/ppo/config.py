"""The configuration of the ``ppo`` method: every ``TrainingArguments`` field, plus PPO's."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from alpacafarm.rewards import EnsembleOptions, check_ensemble
from alpacafarm.training import TrainingDefaults
from alpacafarm_methods.ppo.advantages import KL_PENALTIES
from alpacafarm_methods.ppo.models import VALUE_HEAD_INITS


@dataclass
class PPOMethodConfig(TrainingDefaults, EnsembleOptions, TrainingArguments):
    """Every ``transformers.TrainingArguments`` field, plus PPO's.

    Where each default comes from:

    * **the paper** (Appendix B.1): 512 rollouts per PPO step in 2 epochs of mini-batches of 256, learning rate
      1e-5 decaying linearly to 0, gradient clipping at norm 1, 10 passes over the prompts,
      ``gamma = lambda = 1``, a fixed KL coefficient of 0.002 (simulated feedback; 0.02 for human feedback; the
      released script ``examples/scripts/rlhf_ppo.sh`` defaults to 0.0067, which the paper does not report),
      advantages whitened over the whole rollout batch, the value model initialised from the reward model;
    * **the released AlpacaFarm implementation**, where the paper is silent (its KL coefficients were tuned with
      it): the per-token KL penalty is charged on ``max(log p - log p_ref, 0)`` (``kl_penalty: clamped``; ``k1``
      charges the plain sampled estimate, negative terms included); the KL-shaped per-token rewards are
      whitened over the rollout batch before GAE, their mean kept (``whiten_rewards: true``); ``vf_coef`` 0.1,
      ``cliprange`` 0.2, ``cliprange_value`` 0.2; AdamW epsilon 1e-5 (``adam_epsilon``; transformers'
      default is 1e-8); 5 warm-up PPO steps (the script's ``--warmup_steps 5``; the paper only says the rate decays
      to 0): as released, the learning-rate schedule steps once per PPO step, so ``warmup_steps`` counts PPO
      steps (a fraction below 1 is of ``max_steps``); prompts longer than 192 tokens
      skipped (``max_prompt_length``: the released ``query_len``);
    * **our assumptions**: ``max_new_tokens`` 300 (the paper's models answer in under 300 tokens), sampling at
      temperature 1, the reward-model score as it is (``reward_scale`` 1, no ``reward_clip``, no
      ``missing_eos_penalty``).

    A PPO step is one rollout batch: ``max_steps`` counts PPO steps, ``total_episodes`` counts rollouts, and
    otherwise ``num_train_epochs`` passes over the prompts decide the length. ``per_device_train_batch_size``
    is the micro-batch of every forward pass; gradients accumulate over a mini-batch (so
    ``gradient_accumulation_steps`` is not used). Dropout is turned off (it would bias the PPO ratio).
    The optimizer is AdamW with the arguments' betas, epsilon and weight decay (``optim`` is not used) over
    float32 master weights (the model block's ``dtype`` is for the frozen copies; ``bf16`` autocasts the
    compute on a GPU); checkpoints follow ``save_strategy: steps`` / ``save_steps`` / ``save_total_limit``.
    ``bf16`` and activation checkpointing are automatic (:class:`~alpacafarm.training.TrainingDefaults`).
    """

    split: str = field(default="train",
                       metadata={"help": "file (or named file) of the instruction_splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N prompts only"})
    rollout_batch_size: int = field(default=512, metadata={"help": "responses sampled per PPO step"})
    mini_batch_size: int = field(default=256, metadata={"help": "rollouts per optimizer step"})
    ppo_epochs: int = field(default=2, metadata={"help": "passes over each rollout batch"})
    generation_batch_size: int = field(default=32, metadata={"help": "prompts per generate() call"})
    total_episodes: int | None = field(default=None,
                                       metadata={"help": "total rollouts (overrides num_train_epochs)"})
    kl_coef: float = field(default=0.002, metadata={"help": "per-token KL penalty coefficient (fixed)"})
    kl_penalty: str = field(default="clamped", metadata={
        "help": "per-token KL the penalty is charged on: 'clamped' = max(log p - log p_ref, 0) (the released "
                "AlpacaFarm implementation), 'k1' = log p - log p_ref (the plain sampled estimate)"})
    cliprange: float = field(default=0.2, metadata={"help": "policy ratio clip range"})
    cliprange_value: float = field(default=0.2,
                                   metadata={"help": "value clip range around the rollout values"})
    vf_coef: float = field(default=0.1, metadata={"help": "weight of the value loss"})
    gamma: float = field(default=1.0, metadata={"help": "discount of GAE"})
    lam: float = field(default=1.0, metadata={"help": "lambda of GAE"})
    whiten_rewards: bool = field(default=True, metadata={
        "help": "whiten the KL-shaped per-token rewards over the rollout batch before GAE (variance 1, mean kept; "
                "the released AlpacaFarm implementation); false: GAE on the raw shaped rewards"})
    reward_scale: float = field(default=1.0, metadata={"help": "multiply reward-model scores by this"})
    reward_clip: float | None = field(default=None, metadata={"help": "clip scaled scores to [-c, c]"})
    missing_eos_penalty: float | None = field(default=None,
                                              metadata={"help": "subtract from responses without EOS"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    max_new_tokens: int = field(default=300, metadata={"help": "longest response"})
    max_prompt_length: int | None = field(default=192, metadata={
        "help": "skip prompts with more tokens (released: query_len 192); None: keep every prompt"})
    score_batch_size: int = field(default=8, metadata={"help": "batch size of reward-model scoring"})
    snapshot_steps: int | None = field(default=None, metadata={
        "help": "every N PPO steps, save the policy as a model folder snapshots/step-N/ (listed in the artifact), "
                "so generate_outputs (snapshots: true) can follow win-rate and proxy reward over training (the "
                "paper's over-optimisation, Figure 5); None: only the final policy"})
    value_head_init: str = field(default="zero", metadata={
        "help": "how the critic's head on the reward model's backbone starts: 'zero' = a new head with weight and "
                "bias 0 (the released AlpacaFarm implementation: values start at 0, in the whitened units of the "
                "returns), 'reward_head' = a copy of the reward model's score head (values start as raw scores)"})

    learning_rate: float = 1e-5
    adam_epsilon: float = 1e-5  # the released implementation's (OpenAI's PPO code's); transformers' is 1e-8
    num_train_epochs: float = 10.0
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 5  # PPO steps: the released script's --warmup_steps 5 (its schedule steps once per PPO step)
    logging_steps: float = 1
    save_steps: float = 20

    def __post_init__(self) -> None:
        positive = ("rollout_batch_size", "mini_batch_size", "ppo_epochs", "generation_batch_size",
                    "max_new_tokens", "score_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of "
                             f"mini_batch_size ({self.mini_batch_size})")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive: PPO samples from the policy")
        if self.value_head_init not in VALUE_HEAD_INITS:
            raise ValueError(f"value_head_init must be one of {', '.join(VALUE_HEAD_INITS)}, "
                             f"not {self.value_head_init!r}")
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(f"kl_penalty must be one of {', '.join(KL_PENALTIES)}, not {self.kl_penalty!r}")
        if self.kl_coef < 0 or self.cliprange <= 0 or self.cliprange_value <= 0 or self.vf_coef < 0:
            raise ValueError("kl_coef and vf_coef must be >= 0; cliprange and cliprange_value > 0")
        for name in ("max_instructions", "total_episodes", "max_prompt_length", "snapshot_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.fp16:
            raise ValueError("fp16 is not supported by the PPO trainer; use bf16 (automatic on a suitable "
                             "GPU)")
        check_ensemble(self.ensemble, self.ensemble_coefficient)
        super().__post_init__()  # TrainingDefaults (bf16, checkpointing for this machine), TrainingArguments
