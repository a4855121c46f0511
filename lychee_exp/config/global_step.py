"""Which global step size a run may fix (no torch here: the sweeper checks a sweep's sample trial with it before
the first trial, lychee_exp.train.optim.with_global_batch every run): queries per step
(`trainer.global_batch_size`) for fixed-size batches, tokens per step (`trainer.global_tokens_per_step`) for
token-budget batches (`data.max_tokens_per_batch`), whose steps vary in queries."""

from __future__ import annotations

from lychee_exp.errors import UserError


def check_global_step(queries: int | None, tokens: int | None, budget: int | None) -> None:
    """A one-line UserError for a global step that the batches cannot reach."""
    if queries is not None and tokens is not None:
        raise UserError(
            f"trainer.global_batch_size={queries} and trainer.global_tokens_per_step={tokens} both fix the step: "
            "set one of them to null"
        )
    if queries is not None and budget is not None:
        raise UserError(
            f"trainer.global_batch_size={queries} counts queries per step, but data.max_tokens_per_batch={budget} "
            "makes that number vary: fix tokens per step instead (trainer.global_tokens_per_step; "
            "hparams_search=lr_tokens), or set data.max_tokens_per_batch=null"
        )
    if tokens is not None and budget is None:
        raise UserError(
            f"trainer.global_tokens_per_step={tokens} needs a token budget (data.max_tokens_per_batch, as "
            "experiment=lychee_lora sets); without one, fix queries per step: trainer.global_batch_size "
            "(hparams_search=lr_batch)"
        )
