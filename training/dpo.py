"""Direct preference optimisation (Rafailov et al. 2023): the loss of preference pairs against a reference.

A batch of pairs (loader.PreferenceLoader) is {tokens (B, 2, T+1), weights (B, 2, T), segments (B, 2, T)}:
row b's side 0 holds the chosen sequences of its pairs, side 1 their rejected ones, segment k of both the
same pair. Both sides go through the model as one batch of 2B rows (attention kept inside each segment); a
sequence's log-probability is the sum of its response tokens' (weights 1: the response and its end-of-text,
never the prompt), as TRL sums them. With the reference's (B, 2, K) log-probabilities of the same segments
(from its own forward pass in the step, or precomputed: batch["ref"]), pair k of row b has

    d = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    loss = -(1 - label_smoothing) * log sigmoid(beta * d) - label_smoothing * log sigmoid(-beta * d)

and the metrics TRL logs: rewards/chosen = beta * (policy_chosen - ref_chosen), rewards/rejected likewise,
rewards/accuracies = [chosen reward > rejected reward], rewards/margins = their difference, logps/chosen,
logps/rejected. Everything is summed over the pairs of a micro-batch, with their count, so that gradient
accumulation and the data-parallel reduction give the mean over the pairs of the whole batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from layers import attention as attention_lib
from tokendata.loader import pair_slots

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # besides the loss, per pair, averaged over the batch's pairs (TRL's names)


def flat(batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pair batch's two sides as one batch of rows: tokens (2B, T+1), weights, segments (2B, T)."""
    tokens, weights, segments = batch["tokens"], batch["weights"], batch["segments"]
    B = tokens.shape[0]
    return tokens.reshape(2 * B, -1), weights.reshape(2 * B, -1), segments.reshape(2 * B, -1)


def sequence_logps(token_logps_fn, params, batch: dict, dropout_key=None) -> tuple[jax.Array, jax.Array]:
    """(log-probabilities (B, 2, K) of every segment's response, tokens counted (B, 2, K)), segment k + 1 at k.

    token_logps_fn(params, tokens (R, T+1), dropout_key, mask=, segment_ids=) -> float32 (R, T), the
    log-probability of each next token (model.GPT.token_logps through step.make_token_logps)."""
    tokens, weights, segments = flat(batch)
    R, T = segments.shape
    K = pair_slots(T)
    mask = attention_lib.attention_mask(R, T, segment_ids=segments)
    lp = token_logps_fn(params, tokens, dropout_key, mask=mask, segment_ids=segments)  # (2B, T) float32
    weights = weights.astype(jnp.float32)

    def by_segment(values, ids):  # one row: the sums of segments 1..K
        return jax.ops.segment_sum(values, ids, num_segments=K + 1)[1:]

    sums = jax.vmap(by_segment)(lp * weights, segments)
    counts = jax.vmap(by_segment)(weights, segments)
    B = R // 2
    return sums.reshape(B, 2, K), counts.reshape(B, 2, K)


def pair_sums(policy: jax.Array, reference: jax.Array, counts: jax.Array, beta: float,
              label_smoothing: float) -> tuple[jax.Array, dict]:
    """(summed loss, {"n": pairs, metric: sum}) of the (B, 2, K) policy and reference log-probabilities; a
    slot is a pair where both of its sequences count tokens."""
    valid = ((counts[:, 0] > 0) & (counts[:, 1] > 0)).astype(jnp.float32)  # (B, K)
    reference = jax.lax.stop_gradient(reference)
    chosen = policy[:, 0] - reference[:, 0]
    rejected = policy[:, 1] - reference[:, 1]
    d = chosen - rejected
    losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * d)
              - label_smoothing * jax.nn.log_sigmoid(-beta * d))
    r_chosen, r_rejected = jax.lax.stop_gradient(beta * chosen), jax.lax.stop_gradient(beta * rejected)

    def total(x):
        return jnp.sum(jnp.where(valid > 0, x, 0.0))

    sg = jax.lax.stop_gradient
    aux = {"n": valid.sum(),
           "rewards/chosen": total(r_chosen), "rewards/rejected": total(r_rejected),
           "rewards/accuracies": total((r_chosen > r_rejected).astype(jnp.float32)),
           "rewards/margins": total(r_chosen - r_rejected),
           "logps/chosen": total(sg(policy[:, 0])), "logps/rejected": total(sg(policy[:, 1]))}
    return total(losses), aux


def make_objective(token_logps_fn, dpo, joined, reference_of):
    """objective(params, rows, dropout_key, frozen) -> (summed DPO loss, sums) for step.make_train_step.

    `joined(params, frozen)`: the policy's full parameters (LoRA: the base joined with the adapters);
    `reference_of(params, frozen)`: the reference's (the frozen copy, or the base with its adapters off), used
    where the rows carry no precomputed "ref"."""
    beta, smoothing = dpo.beta, dpo.label_smoothing

    def objective(params, rows, dropout_key, frozen):
        policy, counts = sequence_logps(token_logps_fn, joined(params, frozen), rows, dropout_key)
        if "ref" in rows:
            reference = rows["ref"]
        else:
            reference, _ = sequence_logps(token_logps_fn, jax.lax.stop_gradient(reference_of(params, frozen)), rows)
        return pair_sums(policy, reference, counts, beta, smoothing)

    objective.sums = ("n", *METRICS)
    return objective
