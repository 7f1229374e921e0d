"""The policy loss's names and hyperparameters, checked without tensors: what a config validator
(``primerl rl --dry-run``, the launcher) needs from :mod:`primerl.rl.losses` without loading torch.
:mod:`primerl.rl.losses` re-exports every name here."""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

__all__ = ["LOSS_METHODS", "CORRECTIONS", "SEQUENCE_LEVEL_CORRECTIONS", "AGGREGATIONS", "TERMS", "DEFAULT_HPARAMS",
           "check_loss_spec", "resolve_method", "load_custom_loss"]

LOSS_METHODS = ("ppo_clip", "dppo_tv", "ipo", "gspo", "gspo_token", "cispo", "reinforce")
CORRECTIONS = ("tis", "mis", "icepop", "geo_rs", "veto", "sequence_mask")
SEQUENCE_LEVEL_CORRECTIONS = ("geo_rs", "veto", "sequence_mask")  # and "mis" with mis_level="sequence"
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum_norm", "global_token_sum")
TERMS = ("ref_kl", "sft")

_METHOD_HPARAMS = {
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": None, "kl_coef": 0.0},
    "dppo_tv": {"delta_low": 0.2, "delta_high": 0.2, "kl_coef": 1e-3},
    "ipo": {"ipo_threshold": 0.1, "kl_coef": 1e-3},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0},
    "cispo": {"eps_low": 1.0, "eps_high": 0.28, "kl_coef": 0.0},
    "reinforce": {"kl_coef": 0.0},
}
_CORRECTION_HPARAMS = {
    "tis": {"tis_cap": 2.0},
    "mis": {"mis_low": 0.5, "mis_high": 2.0, "mis_level": "token"},
    "icepop": {"icepop_alpha": 0.5, "icepop_beta": 5.0},
    "geo_rs": {"geo_rs_low": 0.999, "geo_rs_high": 1.001},
    "veto": {"veto_threshold": 1e-4},
    "sequence_mask": {"sequence_mask_low": 0.0, "sequence_mask_high": 100.0},
}
_TERM_HPARAMS = {
    "ref_kl": {"ref_kl_coef": 1.0, "ref_kl_delta": 0.2, "ref_kl_drift": 1e-3},
    "sft": {"sft_coef": 1.0},
}
DEFAULT_HPARAMS = {name: dict(h) for table in (_METHOD_HPARAMS, _CORRECTION_HPARAMS, _TERM_HPARAMS)
                   for name, h in table.items()}
_ALL_HPARAMS = sorted({k for h in DEFAULT_HPARAMS.values() for k in h})
_DEFAULT_AGGREGATION = {"gspo": "seq_mean_token_mean"}


def resolve_method(method: str | Callable) -> tuple[str, Callable | None]:
    """A built-in method name, ``"package.module:function"`` or a callable -> (name, custom function
    or None for a built-in). ValueError when the name is unknown or the import fails."""
    if callable(method):
        return getattr(method, "__qualname__", repr(method)), method
    if not isinstance(method, str):
        raise ValueError(f"policy_loss: method must be a name or a callable, got {type(method).__name__}")
    if ":" in method:
        return method, load_custom_loss(method)
    if method not in LOSS_METHODS:
        raise ValueError(f"policy_loss: unknown method {method!r}; choose one of {LOSS_METHODS} "
                         "or name a custom one as 'package.module:function'")
    return method, None


def load_custom_loss(spec: str) -> Callable:
    """``"package.module:function"`` -> the function (ValueError naming what failed)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name or ":" in fn_name:
        raise ValueError(f"policy_loss: a custom method is named 'package.module:function', got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ValueError(f"policy_loss: method {spec!r}: cannot import module {mod_name!r} "
                         f"({type(e).__name__}: {e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"policy_loss: method {spec!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def _check_hparams(method, custom, corrections, terms, hparams):
    """-> (hparams with defaults for the parts in use, the custom method's kwargs)."""
    used = {} if custom else dict(_METHOD_HPARAMS[method])
    for c in corrections:
        used.update(_CORRECTION_HPARAMS[c])
    for t in terms:
        used.update(_TERM_HPARAMS[t])
    fn_kwargs = {}
    for name in hparams:
        if name in used:
            continue
        if custom:
            fn_kwargs[name] = hparams[name]
        elif name not in _ALL_HPARAMS:
            raise ValueError(f"policy_loss: unknown hyperparameter {name!r}; known: {_ALL_HPARAMS}")
        else:
            raise ValueError(f"policy_loss: hyperparameter {name!r} is not used by method={method!r} with "
                             f"corrections={corrections} and terms={terms}; it uses {sorted(used)}")
    hp = {**used, **{k: v for k, v in hparams.items() if k in used}}
    if hp.get("mis_level", "token") not in ("token", "sequence"):
        raise ValueError(f"policy_loss: mis_level must be 'token' or 'sequence', got {hp['mis_level']!r}")
    for lo, hi in (("eps_low", "eps_high"), ("delta_low", "delta_high"), ("mis_low", "mis_high"),
                   ("icepop_alpha", "icepop_beta"), ("geo_rs_low", "geo_rs_high"),
                   ("sequence_mask_low", "sequence_mask_high")):
        if lo in hp and not (hp[lo] >= 0 and hp[hi] >= 0):
            raise ValueError(f"policy_loss: {lo}/{hi} must be >= 0, got {hp[lo]}/{hp[hi]}")
    for name in ("ipo_threshold", "kl_coef", "ref_kl_coef", "ref_kl_delta", "ref_kl_drift", "sft_coef"):
        if name in hp and not (isinstance(hp[name], (int, float)) and 0 <= hp[name] < float("inf")):
            raise ValueError(f"policy_loss: {name} must be a finite number >= 0, got {hp[name]!r}")
    if hp.get("dual_clip_c") is not None and not hp["dual_clip_c"] > 1:
        raise ValueError(f"policy_loss: dual_clip_c must be > 1 (or None), got {hp['dual_clip_c']}")
    if "tis_cap" in hp and not hp["tis_cap"] > 0:
        raise ValueError(f"policy_loss: tis_cap must be > 0, got {hp['tis_cap']}")
    return hp, fn_kwargs


def check_loss_spec(method, corrections: Sequence[str] | str = (), aggregation: str | None = None,
                    hparams: dict | None = None, terms: Sequence[str] = ()):
    """Check a loss configuration without tensors (what a config validator calls): ValueError naming
    the bad method, correction, aggregation or hyperparameter. ``terms`` lists the extra terms in use
    ("ref_kl", "sft"). -> (method name, custom function or None, the custom method's kwargs,
    corrections tuple, aggregation, hyperparameters with defaults)."""
    name, custom = resolve_method(method)
    if isinstance(corrections, str):
        corrections = (corrections,)
    corrections = tuple(corrections)
    for c in corrections:
        if c not in CORRECTIONS:
            raise ValueError(f"policy_loss: unknown correction {c!r}; choose from {CORRECTIONS}")
    if len(set(corrections)) != len(corrections):
        raise ValueError(f"policy_loss: corrections repeat a name: {corrections}")
    aggregation = aggregation or _DEFAULT_AGGREGATION.get(name, "token_mean")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy_loss: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    for t in terms:
        if t not in TERMS:
            raise ValueError(f"policy_loss: unknown term {t!r}; choose from {TERMS}")
    hp, fn_kwargs = _check_hparams(name, custom, corrections, tuple(terms), dict(hparams or {}))
    return name, custom, fn_kwargs, corrections, aggregation, hp
