"""The names of ``ppo_fast.data`` (stdlib and ppo_fast only, no pyarrow: the command line
builds its options from them): the columns and their presets, the estimators and ``Options``."""

from __future__ import annotations

import dataclasses

from .. import _validate
from .._spec import ESTIMATORS as KL_ESTIMATORS

# Per-token list columns, and per-row columns, in the order errors and summaries list them.
TOKEN_FIELDS = ("rewards", "logprobs", "ref_logprobs", "values", "mask")
ROW_FIELDS = ("score", "uid", "bootstrap", "baseline")
FLOAT_TYPES = ("float", "double")
DEFAULT_BATCH_ROWS = 65_536


class DataError(ValueError):
    """Input ``ppo_fast.data`` refuses: the message names the column, the row and the fix."""


class WriteError(OSError):
    """Writing the output failed (a full disk, a lost mount): raised by ``_stream.Writer`` in the
    caller's thread, an OSError naming the output, whatever pyarrow raised in the writer's."""

    @classmethod
    def of(cls, error: BaseException, name: str | None) -> WriteError:
        if isinstance(error, OSError) and error.errno is not None:
            return cls(error.errno, error.strerror or str(error), name)
        return cls(f"{error} (writing {name})" if name else str(error))


class IfPresent(str):
    """A column name that is read only where the data has a column of that name: the
    ``ppo_fast`` preset's ``mask`` and ``bootstrap`` (data without them has every token valid and
    no truncated row; data with them is computed with them, rather than silently not). Any
    other name, given or a preset's, must be there."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"IfPresent({str(self)!r})"


@dataclasses.dataclass(frozen=True)
class Columns:
    """The names of the columns a rollout dataset holds; None: the dataset has no such column.

    Per token (list columns, one list per row, the lists of a row of one length):
    ``rewards`` (token-level rewards or scores, an alternative to ``score``), ``logprobs`` and
    ``ref_logprobs`` (the policy's and the reference's log-probabilities of the sampled tokens,
    for KL shaping), ``values`` (the critic, for GAE), ``mask`` (0/1 or bool, nonzero where a
    token is an action: holes for tool or observation tokens; by default the column ``mask``
    where the data has one, ``IfPresent``). Per row: ``score`` (the sequence-level reward, added
    on the row's last valid token), ``uid`` (the group label: rows sampled for one prompt share
    it; any type), ``bootstrap`` (the value after a truncated row's last token; by default the
    column ``bootstrap`` where the data has one), ``baseline`` (ReMax's baseline: the reward of
    the greedy response to the row's prompt).
    """

    score: str | None = "score"
    rewards: str | None = None
    logprobs: str | None = "logprobs"
    ref_logprobs: str | None = "ref_logprobs"
    values: str | None = "values"
    mask: str | None = IfPresent("mask")
    uid: str | None = "uid"
    bootstrap: str | None = IfPresent("bootstrap")
    baseline: str | None = None

    def replace(self, **names: str | None) -> Columns:
        """These names with some replaced; an empty string means "no such column"."""
        unknown = sorted(set(names) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"unknown column field {unknown[0]!r}: the fields are "
                f"{', '.join(f.name for f in dataclasses.fields(self))}"
            )
        return dataclasses.replace(self, **{k: (v or None) for k, v in names.items()})


# The presets: how the trainers name these fields when a rollout batch is stored as a table.
PRESETS = {
    # ppo_fast's own names (the defaults of ``Columns``).
    "ppo_fast": Columns(),
    # verl 0.9.1 (verl/trainer/ppo/ray_trainer.py, DataProto keys): batch["token_level_scores"]
    # (per-token scores; token_level_rewards = token_level_scores - beta * KL, the KL of
    # batch["old_log_probs"] against batch["ref_log_prob"]), batch["values"],
    # batch["response_mask"], and non_tensor_batch["uid"] (one per prompt, the group);
    # batch["reward_baselines"] (remax: the greedy response's reward, (bs,)).
    "verl": Columns(
        score=None,
        rewards="token_level_scores",
        logprobs="old_log_probs",
        ref_logprobs="ref_log_prob",
        values="values",
        mask="response_mask",
        uid="uid",
        bootstrap=None,
        baseline="reward_baselines",
    ),
    # OpenRLHF 0.11.2 (openrlhf/trainer/ppo_utils/experience.py, Experience fields):
    # action_log_probs, base_action_log_probs (the reference), values, action_mask per token;
    # rewards (B,) per episode; the group is the prompt (OpenRLHF groups the
    # n_samples_per_prompt samples of one prompt), stored in ``prompts``.
    "openrlhf": Columns(
        score="rewards",
        rewards=None,
        logprobs="action_log_probs",
        ref_logprobs="base_action_log_probs",
        values="values",
        mask="action_mask",
        uid="prompts",
        bootstrap=None,
        baseline=None,
    ),
}


TOKEN_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax")
GROUP_ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "gpg",
    "pass_at_k",
    "reinforce_plus_plus_baseline",
    "opo",
)
# The token estimators whose advantages are whitened over the whole input (``whiten``).
WHITENED_ESTIMATORS = ("gae", "reinforce_plus_plus")
ESTIMATORS = TOKEN_ESTIMATORS + GROUP_ESTIMATORS


@dataclasses.dataclass(frozen=True)
class Options:
    """What to compute.

    ``estimator``: ``gae`` (advantages and returns of ``ppo_fast.gae``), ``reinforce_plus_plus``
    (returns: the discounted returns of ``ppo_fast.discounted_returns``; advantages: them whitened),
    ``remax`` (``ppo_fast.remax``: the discounted returns, and them minus the row's ``baseline``
    column as the advantages, not whitened, as verl's), or a group estimator of ``ppo_fast.outcome``
    over the ``uid`` groups (``grpo``, ``dr_grpo`` = grpo with std=None, ``rloo``, ``gpg``,
    ``pass_at_k``, ``reinforce_plus_plus_baseline``, ``opo``: the baseline is the group's mean score
    weighted by each row's valid tokens), with that function's defaults; a group estimator's returns
    are its advantages, as verl's. ``gamma``, ``lam``: discount and GAE lambda. ``kl_coef``,
    ``kl_estimator``, ``kl_clamp``: KL shaping of the token rewards (``ppo_fast.shape_rewards``;
    ``kl_coef=0`` needs no log-probabilities). ``whiten``: whiten the advantages over every valid
    token of the whole input (gae, reinforce_plus_plus) with ``whiten_eps``, ``unbiased``,
    ``shift_mean`` as ``ppo_fast.whiten``; for ``reinforce_plus_plus_baseline``, its own whitening.
    ``gpg_alpha``: gpg's scale alpha (None: n / max(m, 1) over the whole input, n rows of which m
    have a nonzero score; what ``ppo_fast.data.ray`` passes to each group, computed over the whole
    dataset).
    """

    estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    kl_clamp: float | None = None
    whiten: bool = True
    whiten_eps: float = 1e-8
    unbiased: bool = False
    shift_mean: bool = True
    backend: str | None = None
    gpg_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.gpg_alpha is not None:
            _validate.scalar("gpg_alpha", self.gpg_alpha, lo=0.0, open_lo=True)
        _validate.choice("estimator", self.estimator, ESTIMATORS)
        _validate.choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _validate.scalar("gamma", self.gamma, lo=0.0, hi=1.0)
        _validate.scalar("lam", self.lam, lo=0.0, hi=1.0)
        _validate.scalar("kl_coef", self.kl_coef, lo=0.0)
        _validate.scalar("whiten_eps", self.whiten_eps, lo=0.0)
        if self.estimator in GROUP_ESTIMATORS and self.kl_coef:
            raise ValueError(
                f"kl_coef={self.kl_coef}: the group estimator {self.estimator} compares row "
                "scores, it does not shape token rewards; pass kl_coef=0 (put the KL in the "
                "loss) or use estimator gae or reinforce_plus_plus"
            )

    @property
    def grouped(self) -> bool:
        return self.estimator in GROUP_ESTIMATORS

    @property
    def whitens_tokens(self) -> bool:
        """The advantages are whitened by the moments of every valid token of the input."""
        return self.whiten and self.estimator in WHITENED_ESTIMATORS

    @property
    def needs_first_pass(self) -> bool:
        return self.grouped or self.whitens_tokens
