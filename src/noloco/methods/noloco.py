"""NoLoCo (Kolehmainen et al., 2025; SPEC §3): no all-reduce at all.

Every H inner steps each replica averages with a small random group G instead of all
replicas, through a modified momentum update that also pulls the slow weights together:

    Δ_i = θ_i − φ_i
    δ_i ← α·δ_i + β·mean_{j∈G}(Δ_j) − γ·(φ_i − mean_{j∈G}(φ_j))
    φ_i ← φ_i + δ_i ;   θ_i ← φ_i

(+β, as the paper's appendix and reference code.) That is heavy-ball SGD on φ (lr 1,
momentum α, δ = −momentum buffer) with the pseudo-gradient g = γ·(φ_i − mean_G φ) − β·mean_G Δ:
the outer optimizer is ``torch.optim.SGD``. With γ = β, g = β·(φ_i − mean_G θ): only θ
travels, S bytes each way. δ and the inner optimizer state are local, never reset.

Groups: at exchange e every replica draws the same permutation of 0..N−1 from (seed, e) and
cuts it into N/n groups (for n = 2, perm[j] pairs with perm[j + N/2], as the reference code).

Streaming NoLoCo (this project's extension, docs/streaming.md): the engine's fragments and
overlap, the e-th fragment exchange using ``groups_at(e)``; quantised, a member sends Δ_j in
the chosen format and φ_j − φ⁰ in int8 (φ⁰: the identical starting weights), and every member
uses the decoded values, so all compute the same means and the pull sums to zero over G.

Sparse gossip (``compress="topk:F:BITS"``, this project's extension, issue 25; docs/methods.md
has what it costs): a member sends its Δ_j through an error-feedback buffer as a chunk-wise
top-k (:mod:`noloco.sparse`), and its slow weights φ_j only on a few *pulled* chunks — the
same ``max(1, round(F·chunks))`` chunks of 4096 for every member of the exchange, drawn from
(seed, e), so no index travels — in fp32. The update is the one above with mean_G Δ̂ for
mean_G Δ and the pull γ·(φ_i − mean_G φ) applied on the pulled chunks only. Both members use
the same decoded Δ̂ and the same exact φ values, so the pull still sums to zero over G and
the replicas' mean φ moves only by the mean of what was sent; what the pull no longer does
on every coordinate at every exchange is what the weight spread pays.

Paper symbol → argument: H → ``sync_every``; n → ``group_size``; α → ``momentum`` (0.5);
β → ``outer_lr`` (0.7); γ → ``gamma`` (default β).

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from noloco import quant, sparse
from noloco.comm import Communicator, flatten
from noloco.guard import UpdateGuard, all_finite, distance
from noloco.methods.engine import Fragment, ModelLike, OuterSync, Sync, decode, encode
from noloco.methods.wire import SLOW_FORMAT


def permutation(exchange: int, n: int, seed: int = 0) -> np.ndarray:
    """The random permutation of 0..n−1 that exchange ``exchange`` cuts into groups."""
    return np.random.default_rng([seed, exchange, 0x6E6F6C6F]).permutation(n)


def groups_at(exchange: int, replicas: int, group_size: int, seed: int = 0
              ) -> list[list[int]]:
    """The groups of exchange ``exchange``: identical on every rank that calls it."""
    if replicas % group_size:
        raise ValueError(f"{replicas} replicas are not divisible by group size {group_size}")
    perm = permutation(exchange, replicas, seed)
    k = replicas // group_size
    return [sorted(int(perm[g + j * k]) for j in range(group_size)) for g in range(k)]


def groups_of(members: Sequence[int], exchange: int, group_size: int, seed: int = 0
              ) -> list[list[int]]:
    """The groups of ``exchange`` among ``members`` (an elastic run's snapshot): the static
    draw (:func:`groups_at`) when every replica is a member; otherwise the
    same rule on the members, with the ones left over joining the last group."""
    members = sorted(members)
    perm = permutation(exchange, len(members), seed)
    k = len(members) // group_size
    if k == 0:
        return [members]
    groups = [[members[int(perm[g + j * k])] for j in range(group_size)] for g in range(k)]
    groups[-1] += [members[int(i)] for i in perm[k * group_size:]]
    return [sorted(g) for g in groups]


def stability_bounds(alpha: float, group_size: int) -> tuple[float, float]:
    """γ interval inside which the replicas' weight spread stays bounded (SPEC §3, paper
    appendix, quadratic model): √(n/(2(n−1)))·α < γ < √(n(2+α²)/(2(n−1)))."""
    n = group_size
    return (math.sqrt(n / (2 * (n - 1))) * alpha, math.sqrt(n * (2 + alpha**2) / (2 * (n - 1))))


class NoLoCo(OuterSync):
    name = "noloco"
    extra_state = ("exchanges", "last_group", "start")

    def __init__(self, model: ModelLike, comm: Communicator, *, sync_every: int = 50,
                 outer_lr: float = 0.7, momentum: float = 0.5, gamma: float | None = None,
                 group_size: int = 2, seed: int = 0, compress: str | None = None,
                 ef_decay: float = 1.0, guard: UpdateGuard | None = None,
                 **streaming: Any) -> None:
        n = comm.size
        group_size = 1 if n == 1 else group_size
        if n > 1 and not 2 <= group_size <= n or n % group_size:
            raise ValueError(f"group size {group_size} must be >= 2, not larger than the {n} "
                             f"replicas, which must be divisible by it")
        self.beta, self.alpha = outer_lr, momentum
        self.gamma = outer_lr if gamma is None else gamma
        self.group_size, self.seed = group_size, seed
        lo, hi = stability_bounds(self.alpha, max(group_size, 2))
        if not lo < self.gamma < hi:
            warnings.warn(f"gamma {self.gamma:g} is outside the stability interval ({lo:.3f}, "
                          f"{hi:.3f}) for alpha {self.alpha:g} and group size {group_size}: "
                          f"replicas may drift apart", stacklevel=2)
        super().__init__(model, comm, sync_every=sync_every, guard=guard, **streaming,
                         outer_optimizer=lambda phi: torch.optim.SGD(phi, lr=1.0,
                                                                     momentum=momentum))
        self.exchanges_slow_weights = self.gamma != self.beta or self.quantize != "none"
        # φ⁰, the common reference of the quantised slow-weight part (identical everywhere).
        self.start = [p.clone() for p in self.phi] if self.quantize != "none" else None
        self.exchanges = 0
        """fragment exchanges started so far (e); the next one's groups are groups_at(e)"""
        if compress is not None:
            self.compress_with(compress, ef_decay)
            self.exchanges_slow_weights = True
        self.last_group: list[int] = []

    @property
    def delta(self) -> list[torch.Tensor]:
        """δ, per parameter in model order (the optimizer's momentum buffer is −δ)."""
        return [-b for b in self.outer_momentum()]

    def communicate(self, frag: Fragment, t: int) -> Sync | None:
        """Exchange with this exchange's group: θ (γ = β), θ and φ (γ ≠ β), or quantised Δ
        and φ − φ⁰."""
        if not frag.params:  # a pipeline stage may hold no block of this fragment
            self.exchanges += 1  # every replica counts every scheduled exchange, held or not
            return None
        group = [0]
        if self.comm.size > 1:
            members = self.comm.members()  # None: every replica (a static run)
            if members is None:
                groups = groups_at(self.exchanges, self.comm.size, self.group_size, self.seed)
            else:  # an elastic run: the replicas alive in this exchange's snapshot
                groups = groups_of(members, self.exchanges, self.group_size, self.seed)
            group = next((g for g in groups if self.comm.rank in g), [self.comm.rank])
        self.exchanges += 1
        fast, slow = frag.fast(), frag.slow()
        pulled: list[int] = []
        own_bad = False
        if self.compress is not None:
            # Judged before it enters the error feedback: a bad update folded in would stay
            # in e, and leave in pieces later, past the guard.
            own_bad = self._guard_own(frag, fast)
            delta = fast - slow
            if own_bad:
                delta.zero_()
            pulled = self.pulled_chunks(self.exchanges - 1, frag.numel())
            payload = torch.cat([self.compress.encode(frag.index, delta),
                                 self._chunks(slow, pulled).view(torch.uint8)])
        elif self.quantize != "none":
            payload = torch.cat([encode(fast - slow, self.quantize),
                                 encode(slow - self._ref(frag), SLOW_FORMAT)])
        else:
            payload = torch.cat([fast, slow]) if self.exchanges_slow_weights else fast
        peers = [r for r in group if r != self.comm.rank]
        pending = self.comm.exchange_async(payload, peers)
        return Sync(frag.index, t + self.tau, payload, pending,
                    extra=(group, peers, fast.numel(), self.comm.rank, pulled), own_bad=own_bad)

    def pseudo_gradient(self, frag: Fragment, sync: Sync, received: Any) -> torch.Tensor:
        """g = γ·(φ_i − mean_G φ) − β·mean_G Δ, every mean summed in group order so every
        member of G computes the same bits."""
        group, peers, n = sync.extra[:3]
        # The rank that sent the payload: a replica that joined while this sync was in flight
        # carries its donor's sync, sent under the donor's rank (older checkpoints: this one).
        me = sync.extra[3] if len(sync.extra) > 3 else self.comm.rank
        # An elastic exchange gives None for a member that did not take part: the mean is
        # over the members that did (alone: over this replica only).
        by_rank = {r: m for r, m in zip(peers, received, strict=True) if m is not None}
        by_rank[me] = sync.payload
        if self.guard is not None:
            self._guard(frag, sync, by_rank, me, n)
        group = [r for r in group if r in by_rank]
        msgs = [by_rank[r] for r in group]
        self.last_group = group
        if not msgs:  # its own update rejected and no partner's accepted: φ stays
            return torch.zeros_like(frag.slow())
        if self.compress is not None:
            return self._sparse_gradient(frag, msgs, group, me, n, sync.extra[4])
        if self.quantize != "none":
            split, ref = quant.wire_bytes(n, self.quantize), self._ref(frag)
            deltas = torch.stack([decode(m[:split], n, self.quantize) for m in msgs])
            slows = torch.stack([ref + decode(m[split:], n, SLOW_FORMAT) for m in msgs])
            mine = slows[group.index(me)] if me in group else frag.slow()
            return self.gamma * (mine - slows.mean(0)) - self.beta * deltas.mean(0)
        mean = torch.stack(msgs).mean(0)
        if not self.exchanges_slow_weights:
            return self.beta * (frag.slow() - mean)
        mean_fast, mean_slow = mean[:n], mean[n:]
        return self.gamma * (frag.slow() - mean_slow) - self.beta * (mean_fast - mean_slow)

    # ---- sparse gossip ------------------------------------------------------------------------
    def pulled_chunks(self, exchange: int, numel: int) -> list[int]:
        """The chunks whose slow weights exchange ``exchange`` pulls together: the same on
        every member (drawn from the seed and the exchange alone)."""
        assert self.compress is not None
        c = sparse.num_chunks(numel, self.compress.chunk)
        k = min(c, max(1, round(self.compress.fraction * c)))
        rng = np.random.default_rng([self.seed, exchange, 0x70756C6C])
        return sorted(int(i) for i in rng.choice(c, size=k, replace=False))

    def _chunks(self, flat: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        """The values of ``chunks`` of ``flat``, each a full chunk (the last one zero-padded)."""
        assert self.compress is not None
        size = self.compress.chunk
        padded = torch.zeros(sparse.num_chunks(flat.numel(), size) * size,
                             dtype=torch.float32, device=flat.device)
        padded[:flat.numel()] = flat
        return padded.view(-1, size)[chunks].reshape(-1)

    def _split(self, msg: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse-gossip message: (the packed Δ̂, the pulled chunks' φ as fp32)."""
        assert self.compress is not None
        cut = self.compress.message_bytes(n)
        return msg[:cut], msg[cut:].clone().view(torch.float32)

    def _sparse_gradient(self, frag: Fragment, msgs: list[torch.Tensor], group: list[int],
                         me: int, n: int, pulled: list[int]) -> torch.Tensor:
        """g = γ·(φ_i − mean_G φ) on the pulled chunks − β·mean_G Δ̂."""
        assert self.compress is not None
        parts = [self._split(m, n) for m in msgs]
        # (the update guard, when on, dropped malformed messages already; without it one
        # that does not decode or is not finite adds nothing, rather than stopping the run)
        g = self.compress.mean_of_sound([p[0] for p in parts], n)[0].mul_(-self.beta)
        slows = torch.stack([p[1] for p in parts])
        mine = slows[group.index(me)] if me in group else self._chunks(frag.slow(), pulled)
        pull = (self.gamma * (mine - slows.mean(0))).view(len(pulled), -1)
        size = self.compress.chunk
        for row, c in zip(pull, pulled, strict=True):
            end = min((c + 1) * size, n)
            g[c * size:end] += row[:end - c * size]
        return g

    def _plain(self, msg: torch.Tensor, n: int) -> torch.Tensor:
        """The part of a message that holds plain floats (sparse: the pulled φ)."""
        return self._split(msg, n)[1] if self.compress is not None else msg

    def _fast_of(self, frag: Fragment, msg: torch.Tensor, n: int) -> torch.Tensor:
        """The fast weights θ a member's message carries (decoded when quantised; sparse, this
        replica's φ plus the member's Δ̂)."""
        if self.compress is not None:
            return frag.slow() + self.compress.decode(self._split(msg, n)[0], n)
        if self.quantize != "none":
            split = quant.wire_bytes(n, self.quantize)
            return (self._ref(frag) + decode(msg[split:], n, SLOW_FORMAT)
                    + decode(msg[:split], n, self.quantize))
        return msg[:n]

    def _guard(self, frag: Fragment, sync: Sync, by_rank: dict[int, torch.Tensor], me: int,
               n: int) -> None:
        """Drop from ``by_rank`` every message the update guard rejects (:mod:`noloco.guard`):
        this replica's own first (it sets the scale), then each partner's — judged by the
        distance of its fast weights from this replica's slow weights."""
        guard, phi, own = self.guard, frag.slow(), sync.payload
        assert guard is not None
        # Compressed, this replica's own update was judged before it was sent (communicate).
        first = [] if self.compress is not None else [me]
        for r in [*first, *sorted(r for r in by_rank if r != me)]:
            msg = by_rank[r]
            like = msg.shape == own.shape and msg.dtype == own.dtype
            try:
                theta = self._fast_of(frag, msg, n) if like else None
            except ValueError:  # a sparse message with an index outside its chunk
                like, theta = False, None
            finite = like and all_finite(theta) and all_finite(self._plain(msg, n))
            why = guard.judge(distance(theta, phi) if finite else math.inf, finite, like)
            if why is not None:
                guard.reject(self.inner_steps, "own" if r == me else r, why,
                             fragment=frag.index)
                del by_rank[r]
                if r == me:
                    sync.own_bad = True

    def _ref(self, frag: Fragment) -> torch.Tensor:
        """φ⁰ of the fragment, flat."""
        return flatten([self.start[i] for i in self.fragment_index[frag.index]])
