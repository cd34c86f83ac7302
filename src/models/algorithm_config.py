"""The ``algorithm`` config group as one typed, self-checking dataclass (read by the module and the datamodule).

Every field has one default, here. The defaults are plain GRPO without memory (every iteration on-policy, no
masking, no KL); ``configs/algorithm/empo2.yaml`` sets the EMPO² values and ``configs/algorithm/grpo.yaml`` the
baseline's. A bad value or an unknown key is refused at start-up, before any rollout runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import ListConfig

from src.utils.settings import Settings, follows, int_at_least, number

OFF_POLICY_OLD_LOG_PROB = ("with_tips", "without_tips")  # the prompt π_old of an off-policy step is taken under
SEMANTICS = ("paper", "authors")  # docs/reproducing.md, "The authors' code, difference by difference"


@dataclass
class AlgorithmConfig(Settings):
    """EMPO² / GRPO settings (``algorithm.*``).

    Raises (on construction):
        ValueError: naming the key, the bad value and what was expected.
    """

    PREFIX: ClassVar[str] = "algorithm"

    name: str = "grpo"
    """Label of the algorithm (``empo2`` or ``grpo``), logged with the run."""
    semantics: str = "paper"
    """``paper`` (the paper's method) or ``authors`` (the EMPO² authors' released code where it differs: tips left in
    the current step's off-policy update prompt, whole-response masking on π_old in every mode, masked tokens out of
    the token mean, a token mean per micro-batch, retrieval ties by age on scores rounded to 0.1, the novelty bonus
    out of the advantage, one-episode groups advantaged by their raw return; docs/reproducing.md)."""
    use_memory: bool = False
    """Build the memory callback (tips and novelty bonus)."""
    memory_rollout_prob: float = 0.0
    """p: probability that an iteration's rollout retrieves tips (0.25 in EMPO²)."""
    off_policy_prob: float = 0.0
    """q: probability that a memory rollout is updated off-policy, i.e. with the tips stripped (2/3 in EMPO²)."""
    off_policy_old_log_prob: str = "with_tips"
    """Prompt of the behaviour log-probs of an off-policy step: ``with_tips`` (the rollout prompt) or
    ``without_tips`` (the tip-free update prompt)."""
    mask_modes: list[str] = field(default_factory=list)
    """Update modes that use low-probability token masking (EMPO²: ``[off_policy]``)."""
    lowprob_log_threshold: float = -5.0
    """log δ: tokens with a current log-prob below it lose their policy-gradient term (nats)."""
    mask_level: str = "token"
    """``token`` (mask single tokens) or ``sequence`` (drop a whole response with any such token)."""
    clip_ratio_low: float = 0.2
    """ε_low of the PPO clip, in [0, 1)."""
    clip_ratio_high: float = 0.3
    """ε_high of the PPO clip (asymmetric clip), >= 0."""
    clip_ratio_c: float = 10.0
    """Dual-clip constant c > 1 for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum`` (over the mini-batch's global counts)."""
    norm_adv_by_std: bool = True
    """Divide group-centred returns by the group's std (GRPO); false gives Dr. GRPO advantages."""
    gamma: float = 1.0
    """Discount of the episode return, in [0, 1]."""
    kl_coef: float = 0.0
    """β of the KL penalty to the frozen reference (0: no reference is built)."""
    kl_type: str = "low_var_kl"
    """KL estimator: ``kl``, ``abs``, ``mse`` or ``low_var_kl``."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    recompute_old_log_probs: bool = True
    """Recompute π_old by a forward pass; false reuses the rollout log-probs where the prompt is the rollout's."""
    skip_zero_advantage: bool = False
    """Drop zero-advantage steps from the update (saves compute; rescales token-mean; refused with KL on)."""
    no_signal_patience: int = 3
    """Warn after this many consecutive iterations without a policy-gradient signal (>= 1)."""
    fail_on_no_signal: bool = False
    """Raise instead of warning when the patience is used up."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many consecutive optimizer steps whose gradient norm is NaN or inf (>= 1); each such
    step is skipped (weights and optimizer state untouched)."""
    temperature: float = follows("data.temperature", 1.0)
    """Temperature the log-probs are taken at: the rollout temperature (> 0), ``data.temperature``."""
    rollout_is: str = "none"
    """Rollout importance-sampling correction (TIS): ``none``, ``token`` or ``sequence``. Each token's
    policy-gradient term is weighted by min(π_old / π_rollout, C), per token or per response; the mismatch metrics
    are logged whatever the setting (docs/method.md#rollout-importance-sampling-correction)."""
    rollout_is_cap: float = 2.0
    """C, the truncation of the rollout importance weight (>= 1)."""

    def __post_init__(self) -> None:
        if self.mask_modes is None or isinstance(self.mask_modes, (tuple, ListConfig)):  # YAML's null: none
            self.mask_modes = list(self.mask_modes or [])
        super().__post_init__()

    def problems(self) -> list[str]:
        from src.models.core_algos import KL_KINDS, LOSS_AGG_MODES, MASK_LEVELS, ROLLOUT_IS_LEVELS, UPDATE_MODES

        problems = []
        choices = {"loss_agg_mode": LOSS_AGG_MODES, "mask_level": MASK_LEVELS, "kl_type": KL_KINDS,
                   "off_policy_old_log_prob": OFF_POLICY_OLD_LOG_PROB, "rollout_is": ROLLOUT_IS_LEVELS,
                   "semantics": SEMANTICS}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                problems.append(f"algorithm.{key}={getattr(self, key)!r}: expected one of {valid}")
        bad = [m for m in self.mask_modes if m not in UPDATE_MODES]
        if bad:
            problems.append(f"algorithm.mask_modes has {bad}: expected modes from {UPDATE_MODES}")
        for key in ("memory_rollout_prob", "off_policy_prob", "gamma"):
            if not 0.0 <= float(getattr(self, key)) <= 1.0:
                problems.append(f"algorithm.{key}={getattr(self, key)!r}: expected a value in [0, 1]")
        if not 0.0 <= self.clip_ratio_low < 1.0 or self.clip_ratio_high < 0.0 or self.clip_ratio_c <= 1.0:
            problems.append(f"algorithm.clip_ratio_low/high/c={float(self.clip_ratio_low)}/"
                            f"{float(self.clip_ratio_high)}/{float(self.clip_ratio_c)}: expected 0 <= low < 1, "
                            "high >= 0, c > 1")
        problems += int_at_least("algorithm.no_signal_patience", self.no_signal_patience, 1)
        problems += int_at_least("algorithm.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        if number(self.kl_coef) is None or self.kl_coef < 0:
            problems.append(f"algorithm.kl_coef={self.kl_coef!r}: the weight of the KL penalty to the reference (a "
                            "negative one pushes the policy away from it); expected a number >= 0")
        if number(self.lowprob_log_threshold) is None or self.lowprob_log_threshold > 0:
            problems.append(f"algorithm.lowprob_log_threshold={self.lowprob_log_threshold!r}: log δ, a "
                            "log-probability (-5 in the paper); expected a number <= 0")
        if not self.rollout_is_cap >= 1.0:
            problems.append(f"algorithm.rollout_is_cap={self.rollout_is_cap!r}: expected a cap >= 1")
        if not float(self.temperature) > 0:
            problems.append(f"algorithm.temperature={self.temperature!r}: expected > 0")
        # Skipping a zero-advantage step drops its KL term too (the step never reaches the loss), so the KL
        # penalty would silently cover only part of the batch; and keeping those steps for the KL alone saves nothing.
        if self.skip_zero_advantage and float(self.kl_coef) > 0:
            problems.append(f"algorithm.skip_zero_advantage=true with algorithm.kl_coef={self.kl_coef}: "
                            "skipped steps would lose their KL term; set one of them to false/0")
        return problems
