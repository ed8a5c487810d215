"""The configuration of the ``quark`` method: every ``TrainingArguments`` field, plus the rollout loop's."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from alpacafarm.rewards import EnsembleOptions, check_ensemble
from alpacafarm.training import TrainingDefaults

#: Where a round's top quantile is cut: across the whole pool (released) or within each instruction's rollouts.
QUANTILE_SCOPES = ("pool", "instruction")


@dataclass
class QuarkMethodConfig(TrainingDefaults, EnsembleOptions, TrainingArguments):
    """Every ``transformers.TrainingArguments`` field (they apply to each round's training), plus the loop's.

    From the paper (Appendix B.2): KL coefficient 0.05, peak learning rate 3e-6 decaying to 0 over the whole
    run, 512 rollouts per round, gradient clipping at norm 1, 390 rounds (10 passes over the 20k unlabeled
    instructions), no entropy term.

    From the released implementation (``alpaca_farm/rl/quark_trainer.py``), where the paper says less: the pool is
    sorted by reward and cut into 4 bins of ``pool // 4`` samples, the top bin trained on (``top_quantile`` 0.25,
    rounded *down*: 128 of 512); each round takes one optimizer step (``steps_per_round``) on a batch of 256
    examples (``step_batch_size``) drawn by cycling through the kept samples in a freshly shuffled order (128 kept,
    256 drawn: the paper's "2 epochs of gradient updates with batch size 256"); the schedule is linear after 5
    warm-up rounds (``examples/scripts/rlhf_quark.sh``: ``--warmup_steps 5``; the paper only says the rate decays to
    0); AdamW epsilon 1e-5 (``adam_epsilon``, the released ``quark_utils`` default, "the UW Quark code's";
    transformers' is 1e-8); a kept sample's stop token is never trained (``train_eos: false``: the released trainer
    decodes rollouts without special tokens and re-tokenizes them; ``true`` trains it, so the policy also learns
    when the kept answers stop). ``per_device_train_batch_size`` is the micro-batch: ``gradient_accumulation_steps``
    is derived (``step_batch_size / (per_device_train_batch_size x processes)``; set it only to that value or leave
    it at 1). ``num_train_epochs`` and ``max_steps`` do not apply (leave them unset). The learning rate steps once
    per optimizer step, so with one step per round it steps once per round, as released.

    Ours (the paper states neither): sampling temperature 1.0 and ``max_new_tokens`` 300 (the paper's decoding
    cap). ``output_dir`` is always the stage folder. Every ``save_rounds`` rounds the trainer writes
    ``checkpoint-<step>`` with ``accelerator.save_state`` (the newest ``save_total_limit`` = 2 kept); a killed stage
    resumes after the last one (``save_strategy`` / ``save_steps`` do not apply: a checkpoint between two optimizer
    steps of a round could not resume the rollout loop). ``bf16`` and activation checkpointing are automatic
    (:class:`~alpacafarm.training.TrainingDefaults`).
    """

    rounds: int = field(default=390,
                        metadata={"help": "rollout-score-train rounds (the paper's Quark steps)"})
    prompts_per_round: int | None = field(
        default=512,
        metadata={"help": "instructions sampled per round, cycling through a seeded order (None: all)"})
    rollouts_per_prompt: int = field(default=1, metadata={"help": "samples drawn per instruction in a round"})
    top_quantile: float = field(
        default=0.25,
        metadata={"help": "share of each round's pool kept (highest rewards), rounded down, at least one; "
                          "0.25 = the top of the released run's 4 reward bins"})
    quantile_scope: str = field(
        default="pool",
        metadata={"help": "'pool': the top quantile of the whole round's pool (released); 'instruction': the top "
                          "quantile of each instruction's rollouts (needs rollouts_per_prompt >= 2)"})
    steps_per_round: int = field(default=1, metadata={"help": "optimizer steps per round (released: 1)"})
    step_batch_size: int = field(
        default=256,
        metadata={"help": "examples per optimizer step, drawn cycling through the kept samples in a seeded "
                          "shuffled order (released: 256); micro-batches of per_device_train_batch_size"})
    kl_coef: float = field(default=0.05, metadata={"help": "beta: weight of KL(policy || SFT reference)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold of the rollouts"})
    max_new_tokens: int = field(default=300, metadata={"help": "longest rollout, in tokens"})
    train_eos: bool = field(default=False, metadata={
        "help": "train the stop token of the kept samples that finished; false (released): never trained, as the "
                "released trainer re-tokenizes decoded text without EOS"})
    generation_batch_size: int = field(default=16, metadata={"help": "prompts per generate() call"})
    score_batch_size: int = field(default=16, metadata={"help": "texts per reward-model forward pass"})
    split: str = field(default="train",
                       metadata={"help": "file (or named file) of the instruction splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N instructions only"})
    save_rounds: int = field(default=1, metadata={
        "help": "write checkpoint-<step> (trained tensors, optimizer state, round statistics) every this many "
                "rounds, so a killed stage resumes after its last one; 0: never"})

    learning_rate: float = 3e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 5  # optimizer steps = rounds (one step per round): the released script's 5
    adam_epsilon: float = 1e-5  # the released implementation's; transformers' is 1e-8
    num_train_epochs: float = 1.0
    max_grad_norm: float = 1.0
    logging_steps: float = 1
    save_strategy: str = "no"
    save_total_limit: int | None = 2  # round checkpoints kept: a damaged newest one falls back to the one before

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, "rounds must be at least 1"),
            (self.prompts_per_round is None or self.prompts_per_round >= 1,
             "prompts_per_round must be at least 1"),
            (self.rollouts_per_prompt >= 1, "rollouts_per_prompt must be at least 1"),
            (0.0 < self.top_quantile <= 1.0, "top_quantile must be in (0, 1]"),
            (self.quantile_scope in QUANTILE_SCOPES,
             f"quantile_scope must be one of {', '.join(QUANTILE_SCOPES)}, not {self.quantile_scope!r}"),
            (self.quantile_scope != "instruction" or self.rollouts_per_prompt >= 2,
             "quantile_scope: instruction needs rollouts_per_prompt >= 2 (one rollout per prompt keeps them all)"),
            (self.steps_per_round >= 1, "steps_per_round must be at least 1"),
            (self.step_batch_size >= 1, "step_batch_size must be at least 1"),
            (self.step_batch_size % max(self.per_device_train_batch_size, 1) == 0,
             "step_batch_size must be a multiple of per_device_train_batch_size (the micro-batch)"),
            (self.num_train_epochs == 1.0, "num_train_epochs does not apply to quark: each round takes "
             "steps_per_round optimizer steps of step_batch_size examples"),
            (self.max_steps in (-1, 0, self.steps_per_round),
             "max_steps does not apply to quark: set steps_per_round (optimizer steps per round) and rounds"),
            (self.kl_coef >= 0.0, "kl_coef must be non-negative"),
            (self.temperature > 0.0, "temperature must be positive (rollouts are sampled)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.generation_batch_size >= 1, "generation_batch_size must be at least 1"),
            (self.score_batch_size >= 1, "score_batch_size must be at least 1"),
            (self.max_instructions is None or self.max_instructions >= 1,
             "max_instructions must be at least 1"),
            (self.save_rounds >= 0, "save_rounds must be at least 0 (0: no round checkpoints)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_ensemble(self.ensemble, self.ensemble_coefficient)
        super().__post_init__()  # TrainingDefaults (bf16, checkpointing for this machine), TrainingArguments
