"""L-BFGS on many independent problems at once: the restarts of one attack, each with its own curvature history,
step sizes and stopping tests, advanced together so that each objective evaluation is one batched computation.

Row r of the variables (R, P) is restart r. What each row does is torch.optim.LBFGS's step without line search,
row by row: `max_iter` inner iterations per step, at most `max_eval` evaluations, the first step of size
min(1, 1 / ||g||_1) x lr and lr after it, the pair (s, y) kept only where y.s > 1e-10, the same tests on
tolerance_grad (max |g|) and tolerance_change (directional derivative, max |t d|, |loss change|), `history_size`
pairs (the oldest dropped first), H_diag = y.s / y.y from the newest pair. A row that stops its inner loop early
waits for the others; only the rows still iterating are evaluated.

The direction is the two-loop recursion's, computed in its compact form (Byrd, Nocedal and Schnabel, Mathematical
Programming 1994): the inner products s_i.y_j and y_i.y_j are kept in small Gram matrices (updated when a pair is
stored), and each loop becomes one triangular solve, so a step costs three batched matrix products instead of
4 x history_size vector operations per row. Same mathematics, other rounding: tests/test_batched_restarts.py
bounds the difference to torch.optim.LBFGS in float64.

Where the time goes (benchmarks/attack_speed.py --only dlg-parts): the two passes over the history (16 rows x 200
vectors x 3,082 variables for DLG's LeNet) cost about as much as the objective. The first pass (the inner products)
runs over the rows still iterating only, in views of neighbouring rows, since a row's products do not depend on
which other rows share the call (checked bit for bit); the second (the combination) runs over all rows, since this
CPU's batched product rounds a row differently by its place in the batch. The small per-pair arrays are kept oldest
to newest, so the two-loop reads them as they are. Both changes leave every number as it was.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# (rows: the indices (n,) of the rows to evaluate, x: their variables (n, P)) -> (loss (n,), gradient (n, P))
Closure = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
# torch.optim.LBFGS keeps a pair only where y.s exceeds this (an absolute threshold in its code)
CURVATURE_MIN = 1e-10


class BatchedLBFGS:
    """L-BFGS (torch.optim.LBFGS semantics, no line search) on every row of x (R, P) independently.

    `evaluate(rows)` computes the loss and gradient of the rows (cached until they move); `step(rows)` makes one
    optimiser step on each row in the boolean mask `rows`, as torch.optim.LBFGS.step(closure) does on one problem,
    and returns each row's loss at the start of the step (the value torch's step returns). `x`, `evaluations`
    (closure evaluations per row) and `loss` (the last evaluated loss per row, float64) are readable.
    """

    def __init__(self, x: Tensor, closure: Closure, lr: float = 1.0, max_iter: int = 20, max_eval: int | None = None,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100):  # fmt: skip
        if x.dim() != 2:
            raise ValueError(f"x must be (rows, variables), got shape {tuple(x.shape)}")
        self.x, self.closure = x.detach().clone(), closure
        self.lr, self.max_iter, self.history = float(lr), int(max_iter), int(history_size)
        self.max_eval = int(max_eval) if max_eval is not None else self.max_iter * 5 // 4
        self.tolerance_grad, self.tolerance_change = tolerance_grad, tolerance_change
        R, P = x.shape
        H = self.history
        new, long = self.x.new_zeros, dict(dtype=torch.long, device=x.device)
        self.loss = torch.full((R,), float("nan"), dtype=torch.float64, device=x.device)
        self.prev_loss = self.loss.clone()
        self.g, self.prev_g, self.d = new(R, P), new(R, P), new(R, P)
        self.t, self.h_diag = new(R), new(R) + 1
        self.n_iter, self.evaluations = torch.zeros(R, **long), torch.zeros(R, **long)
        self.fresh = torch.zeros(R, dtype=torch.bool, device=x.device)  # loss and g are those of the current x
        # The history: rows 0..H-1 the steps s, H..2H-1 the gradient changes y, by physical slot (a ring per row).
        self.pairs = new(R, 2 * H, P)
        # The small arrays by position instead, oldest (0) to newest (H - 1), so that the two-loop reads them as they
        # are (gathering them by slot cost as much as a pass over the history); a stored pair shifts them by one.
        self.ro = new(R, H)  # 1 / y.s
        self.sy, self.yy = new(R, H, H), new(R, H, H)  # s_a.y_b and y_a.y_b, positions (a, b)
        self.head, self.count = torch.zeros(R, **long), torch.zeros(R, **long)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, rows: Tensor) -> Tensor:
        """The loss of every row in the mask `rows` at its current x (evaluated now where not cached)."""
        self._evaluate(rows & ~self.fresh)
        return self.loss

    def _evaluate(self, rows: Tensor) -> None:
        idx = rows.nonzero().flatten()
        if idx.numel() == 0:
            return
        loss, grad = self.closure(idx, self.x[idx])
        self.loss[idx] = loss.detach().to(torch.float64)
        self.g[idx] = grad.detach()
        self.evaluations[idx] += 1
        self.fresh[idx] = True

    # -- one step --------------------------------------------------------------------------------------------------
    def step(self, rows: Tensor) -> Tensor:
        """One torch.optim.LBFGS step on every row of the mask `rows`; each row's loss at the start of the step."""
        self.evaluate(rows)
        orig = torch.where(rows, self.loss, torch.full_like(self.loss, float("nan")))
        going = rows & ~(self.g.abs().amax(-1) <= self.tolerance_grad)
        evals = rows.long()  # evaluations of this step per row (the first above)
        n = 0
        while n < self.max_iter and bool(going.any()):
            n += 1
            self.n_iter += going.long()
            first = going & (self.n_iter == 1)
            self._direction(going, first)
            self.prev_g = torch.where(going[:, None], self.g, self.prev_g)
            self.prev_loss = torch.where(going, self.loss, self.prev_loss)
            inverse = 1.0 / self.g.abs().sum(-1)
            first_t = torch.where(inverse < 1.0, inverse, torch.ones_like(inverse)) * self.lr
            self.t = torch.where(first, first_t, torch.where(going, torch.full_like(self.t, self.lr), self.t))
            gtd = (self.g * self.d).sum(-1)
            going = going & ~(gtd > -self.tolerance_change)
            self.x = torch.where(going[:, None], self.x + self.t[:, None] * self.d, self.x)
            self.fresh &= ~going
            if n != self.max_iter:
                self._evaluate(going)
                evals += going.long()
            stop = (evals >= self.max_eval) | (self.g.abs().amax(-1) <= self.tolerance_grad)
            stop |= (self.d * self.t[:, None]).abs().amax(-1) <= self.tolerance_change
            stop |= (self.loss - self.prev_loss).abs() < self.tolerance_change
            going = going & ~stop
        self.fresh &= ~rows  # as torch: the next step evaluates its starting point again
        return orig

    def _direction(self, going: Tensor, first: Tensor) -> None:
        """The new direction d of the rows in `going`: -g on a row's very first iteration (its history emptied),
        else the pair (s, y) of the last move stored where y.s > 1e-10 and the two-loop recursion's direction."""
        later = going & ~first
        if bool(first.any()):
            self.count = torch.where(first, torch.zeros_like(self.count), self.count)
            self.head = torch.where(first, torch.zeros_like(self.head), self.head)
            self.h_diag = torch.where(first, torch.ones_like(self.h_diag), self.h_diag)
        if bool(later.any()):
            y = self.g - self.prev_g
            s = self.d * self.t[:, None]
            ys = (y * s).sum(-1)
            stored = later & (ys > CURVATURE_MIN)
            slot = self._write(stored, s, y, ys)
            # y and s of the new pair, and g, against every stored s and y: one pass over the history of the rows
            # still iterating (indexing the history by rows would copy it, so each run of neighbouring rows is a view)
            runs = _runs(later)
            dots = self.g.new_zeros(self.g.shape[0], 3, 2 * self.history)
            vectors = torch.stack([y, s, self.g], 1)
            for a, b in runs:
                dots[a:b] = torch.bmm(vectors[a:b], self.pairs[a:b].transpose(1, 2))
            self._update_gram(stored, slot, dots)
            d = self._two_loop(self.g, dots[:, 2])
        else:
            d = self.d
        self.d = torch.where(first[:, None], -self.g, torch.where(later[:, None], d, self.d))

    def _write(self, rows: Tensor, s: Tensor, y: Tensor, ys: Tensor) -> Tensor:
        """Store (s, y) in the slot after the newest of each row of `rows` (over the oldest once full); the slots.
        The small per-pair arrays move one position towards the oldest, the new pair taking the newest."""
        H = self.history
        idx = rows.nonzero().flatten()
        slot = self.head[idx]
        self.pairs[idx, slot] = s[idx]
        self.pairs[idx, H + slot] = y[idx]
        self.ro[idx] = torch.roll(self.ro[idx], -1, 1)
        self.ro[idx, H - 1] = 1.0 / ys[idx]
        self.sy[idx] = torch.roll(self.sy[idx], (-1, -1), (1, 2))
        self.yy[idx] = torch.roll(self.yy[idx], (-1, -1), (1, 2))
        self.h_diag[idx] = ys[idx] / (y[idx] * y[idx]).sum(-1)
        self.head[idx] = (slot + 1) % H
        self.count[idx] = torch.clamp(self.count[idx] + 1, max=H)
        return slot

    def _slots(self) -> Tensor:
        """(R, H): the physical slot of each position, oldest (0) to newest (H - 1); the last `count` are valid."""
        H = self.history
        pos = torch.arange(H, device=self.head.device)
        return (self.head[:, None] - H + pos[None, :]) % H

    def _update_gram(self, rows: Tensor, slot: Tensor, dots: Tensor) -> None:
        """The Gram matrices' newest row and column of each row of `rows`, from dots (R, 3, 2H): y_new and s_new
        against every stored s and y, by physical slot."""
        H = self.history
        idx = rows.nonzero().flatten()
        if idx.numel() == 0:
            return
        order = self._slots()[idx]
        y_s, y_y, s_y = (dots[idx, i, off:off + H].gather(1, order) for i, off in ((0, 0), (0, H), (1, H)))
        self.sy[idx, :, H - 1] = y_s  # s_a . y_new
        self.sy[idx, H - 1, :] = s_y  # s_new . y_b
        self.yy[idx, :, H - 1] = y_y
        self.yy[idx, H - 1, :] = y_y

    def _two_loop(self, g: Tensor, g_dots: Tensor) -> Tensor:
        """-H g for every row, H the L-BFGS inverse Hessian of the row's history (the two-loop recursion); g_dots
        (R, 2H): g against every stored s and y, by slot (read only where the row iterates)."""
        H = self.history
        R = g.shape[0]
        slot = self._slots()
        pos = torch.arange(H, device=g.device)
        valid = pos[None, :] >= (H - self.count[:, None])
        ro = torch.where(valid, self.ro, torch.zeros_like(self.ro))
        both = valid[:, :, None] & valid[:, None, :]
        # s_a.y_b for a older than b (the strict upper triangle), both valid: the first loop's matrix, and transposed
        # the second's
        sy = torch.where(both & torch.ones(H, H, dtype=torch.bool, device=g.device).triu(1), self.sy, 0.0)
        yy = torch.where(both, self.yy, torch.zeros_like(self.yy))
        sg, yg = g_dots[:, :H].gather(1, slot), g_dots[:, H:].gather(1, slot)
        sg, yg = torch.where(valid, sg, torch.zeros_like(sg)), torch.where(valid, yg, torch.zeros_like(yg))
        upper = sy * ro[:, :, None]
        # first loop, newest to oldest: al_i = ro_i s_i.(-g - sum_{j newer} al_j y_j)
        al = torch.linalg.solve_triangular(upper, (-ro * sg)[:, :, None], upper=True, unitriangular=True)[..., 0]
        h = self.h_diag[:, None]
        c = h * (-yg - torch.bmm(yy, al[:, :, None])[..., 0])  # y_i . r0, r0 = H_diag (-g - sum_j al_j y_j)
        lower = sy.transpose(1, 2).contiguous() * ro[:, :, None]  # contiguous: the solver's rounding follows the layout
        # second loop, oldest to newest: e_i = al_i - be_i, be_i = ro_i y_i.(r0 + sum_{j older} e_j s_j)
        e = torch.linalg.solve_triangular(lower, (al - ro * c)[:, :, None], upper=False, unitriangular=True)[..., 0]
        coef = torch.zeros(R, 2 * H, dtype=g.dtype, device=g.device)
        coef.scatter_(1, slot, torch.where(valid, e, torch.zeros_like(e)))
        coef.scatter_(1, slot + H, torch.where(valid, -h * al, torch.zeros_like(al)))
        # all rows, not only the iterating ones: this batched product's rounding depends on where a row sits in the
        # batch (measured here; the inner products' does not), and this pass is the cheaper of the two
        return -h * g + torch.bmm(coef[:, None, :], self.pairs)[:, 0]


def _runs(rows: Tensor) -> list[tuple[int, int]]:
    """The runs of neighbouring True entries of a boolean vector, as (start, stop) pairs."""
    out: list[tuple[int, int]] = []
    for i, on in enumerate(rows.tolist()):
        if on and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif on:
            out.append((i, i + 1))
    return out

