"""One node's training state and its round: H inner AdamW steps, then an outer step.

The worker process drives a ``Trainer``; the trainer never touches the network. At a
round boundary it exports φ and Δ as one wire buffer (``outer_payload``), and applies the
outer step of its algorithm (``apply_noloco``, ``apply_diloco``, ``apply_local``). A partner's buffer is
checked before anything changes: wrong size, or any NaN/Inf, and the round falls back to
the no-partner step, so bad input never reaches the weights.

The payload is φ then Δ, each parameter a piece, encoded by the run's ``compression``
(training/encodings/: "none" float32, 4 bytes a value; "int8" blockwise, ≈ 3.9× fewer).
With a lossy encoding each side averages the decoded values of both payloads: what it sent
is kept (``sent``) and stands in for its own φ and Δ in the outer step.
"""

import time
from collections.abc import Callable
from typing import Any

import torch

from training.checkpoint import CheckpointError
from training.data import Shard
from training.encodings import encoding
from training.finite import all_finite_each, finite_flags
from training.models import GPT
from training.noloco import (
    Params,
    PartnerBounds,
    PartnerRefused,
    PeerTensors,
    diloco_step,
    judge_partner,
    noloco_step,
    outer_gradient,
    partner_norms,
)
from training.settings import InnerConfig, OuterConfig


class PayloadRejected(ValueError):
    """A partner's outer payload failed the checks; the round goes on without it.
    ``drifted``: only too far from ours, not by much (``PartnerBounds.ban_factor``)."""

    def __init__(self, message: str, *, drifted: bool = False) -> None:
        super().__init__(message)
        self.drifted = drifted


class Trainer:
    def __init__(
        self,
        model: GPT,
        shard: Shard,
        *,
        inner: InnerConfig,
        outer: OuterConfig,
        seed: int,
        compression: str = "none",
        device: str = "cpu",
        compile_model: bool = False,
        bounds: PartnerBounds | None = None,
        outer_params: list[torch.nn.Parameter] | None = None,
    ) -> None:
        self.encoding = encoding(compression)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        # torch.compile pays off on CUDA (fused kernels); on a CPU and a small model it
        # mostly costs compile time, so it is off there unless asked for.
        self._loss = torch.compile(model.loss) if compile_model else model.loss
        # bf16 autocast on CUDA: the weights, φ, momentum and payloads stay float32.
        self._autocast = self.device.type == "cuda"
        self.shard = shard
        self.inner = inner
        self.outer = outer
        self.seed = seed
        self.step = 0
        self.round = 0
        self._params = list(model.parameters()) if outer_params is None else list(outer_params)
        """What the outer step averages (φ, Δ, m and the payload): every parameter, or
        SPES's shared ones (training/spes.py)."""
        self._trainable = list(self._params)
        """What AdamW steps: the outer parameters, plus SPES's owned experts."""
        self.phi = [p.detach().clone() for p in self._params]
        self.momentum = [torch.zeros_like(p) for p in self._params]
        self.optimizer = self._new_optimizer()
        self.payload_numel = 2 * sum(p.numel() for p in self._params)
        """Values in a payload: φ and Δ."""
        self._numels = [p.numel() for p in self._params] * 2
        self.payload_nbytes = self.encoding.nbytes(self._numels)
        """Bytes of a payload on the wire."""
        self._sent: PeerTensors | None = None
        self._sent_flat: torch.Tensor | None = None
        """``_sent`` as one flat tensor: what a decoder fills in from (``Encoding.decode``)."""
        self._wire: torch.Tensor | None = None
        """This round's payload, once made."""
        self.codec_state: dict[str, Any] = {}
        """The encoding's own state between rounds (sparseloco: its error feedback); its
        tensors go into the checkpoint as ``encoding.<name>``."""
        self.bounds = bounds or PartnerBounds()
        self.last_rejection: str | None = None
        """Why the last partner payload was refused (None if it was used, or there was none)."""
        self.last_rejection_drifted = False
        """The last refusal was of a replica that drifted, not of an attack (a point, no ban)."""
        self._round_end: list[torch.Tensor] | None = None
        """θ as the last round ended, while the next round's first inner steps run before
        its outer step (``hold_round_end``); ``theta()`` is this then."""
        self._overlap_start: list[torch.Tensor] | None = None
        """Where those steps started from: the outer step lands under what they added to it."""
        self._landing = False
        self.landing_steps = 0
        """With ``landing``: how many steps to take before ``land`` (as many as before the save)."""
        self.slowdown = 1.0
        """A simulated slower machine (``simulate --slow-node``): each inner step is followed
        by a pause of (slowdown − 1) × its time."""
        self.next_round_steps = inner.steps_per_round
        """Inner steps of the coming round: H, or fewer while the node catches up with peers
        ahead of it (the daemon's word, node/algorithms/noloco/lag.py ``catch_up_steps``)."""
        self.steps_this_round = inner.steps_per_round
        """Inner steps the round whose payload is out took: a partner's Δ over H steps is
        measured against ours scaled to H (``check_partner``'s ``scale``)."""
        self.expert_load: list[float] | None = None
        """A mixture of experts: each expert's share of the routed tokens over the last
        ``val_loss`` (mean over layers and batches; 1 / num_experts when balanced)."""

    def _new_optimizer(self) -> torch.optim.AdamW:
        # Fused on CUDA: one kernel for every parameter (measured on the H100: the unfused
        # step cost ~3 ms of a gpt-125m step). On a CPU the reference path, unchanged.
        fused = True if self.device.type == "cuda" else None
        return torch.optim.AdamW(self._trainable, lr=self.inner.lr, weight_decay=self.inner.weight_decay, fused=fused)

    def memory(self) -> dict[str, int]:
        """What training holds per parameter, measured: trainable and total parameters, the
        bytes of gradients (after the last backward) and of optimizer state (AdamW's moments,
        the outer momentum and the outer step's copy φ of the slow weights)."""
        adam = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return {
            "trainable_params": sum(p.numel() for p in self._trainable),
            "total_params": sum(p.numel() for p in self.model.parameters()),
            "grad_bytes": sum(p.grad.nbytes for p in self.model.parameters() if p.grad is not None),
            "optimizer_state_bytes": sum(
                t.nbytes for t in (*adam, *self.momentum, *self.phi, *self._codec_tensors(), *self._overlap_tensors())
            ),
        }

    def _overlap_tensors(self) -> list[torch.Tensor]:
        return [*(self._round_end or []), *(self._overlap_start or [])]

    def _codec_tensors(self) -> list[torch.Tensor]:
        return [t for t in self.codec_state.values() if isinstance(t, torch.Tensor)]

    def tokens_per_round(self, steps: int | None = None) -> int:
        """Tokens the inner steps of one round train on (a batch's inputs, H times, or ``steps``)."""
        context_len = self.shard.train.shape[1] - 1  # a block is its inputs and one more target
        return (self.inner.steps_per_round if steps is None else steps) * self.inner.batch_size * context_len

    def inner_steps(self, steps: int | None = None, *, until: Callable[[], bool] | None = None) -> float:
        """``steps`` (H if None) AdamW steps on θ, fewer if ``until()`` says so before one;
        returns the mean training loss of those taken (0.0 for none)."""
        self.model.train()
        # The losses add up where they are (float64, as Python floats would: the same sum on
        # a CPU) and are read once: a read per step waits for the GPU each step.
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for _ in range(self.inner.steps_per_round if steps is None else steps):
            if until is not None and until():
                break
            started = time.perf_counter()
            inputs, targets = self._batch()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
                loss = self._loss(inputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(self._trainable, self.inner.grad_clip)
            self.optimizer.step()
            total += loss.detach().double()
            self.step += 1
            count += 1
            if self.slowdown > 1:  # a slower machine, simulated (the device's work done first)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        return float(total.item()) / count if count else 0.0

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's batch on the device: on CUDA from page-locked memory, copied without
        waiting (a pageable copy stalls the step; measured on the H100)."""
        inputs, targets = self.shard.batch(batch_size=self.inner.batch_size, seed=self.seed, step=self.step)
        if self.device.type != "cuda":
            return inputs.to(self.device), targets.to(self.device)
        return (
            inputs.pin_memory().to(self.device, non_blocking=True),
            targets.pin_memory().to(self.device, non_blocking=True),
        )

    @torch.no_grad()
    def val_loss(self, num_rows: int) -> float:
        """The mean loss over ``num_rows`` validation blocks spread over the split (all of
        them if it has no more: ``Shard.val_batches``), each block weighing alike."""
        self.model.eval()
        batches = self.shard.val_batches(batch_size=self.inner.batch_size, num_rows=num_rows)
        total = 0.0
        moes = self.model.moes()
        load = torch.zeros(moes[0].num_experts, device=self.device) if moes else None
        for x, y in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
                total += self.model.loss(x.to(self.device), y.to(self.device)).item() * len(x)
            if load is not None:
                load += torch.stack([m.load for m in moes]).mean(dim=0)
        if load is not None:
            self.expert_load = [round(float(v), 5) for v in load / len(batches)]
        return total / sum(len(x) for x, _ in batches)

    @torch.no_grad()
    def phi_val_loss(self, num_rows: int) -> float:
        """``val_loss`` of φ, the weights a checkpoint and ``export`` hold (θ differs from
        it by what payloads left out: sparseloco's residual), θ put back after, bit for bit."""
        params = [p.detach() for p in self._params]
        theta = [p.clone() for p in params]
        torch._foreach_copy_(params, self.phi)
        try:
            return self.val_loss(num_rows)
        finally:
            torch._foreach_copy_(params, theta)

    def theta(self) -> list[torch.Tensor]:
        """θ as the round ended: what Δ, a payload and the outer step are made of."""
        if self._round_end is not None:
            return self._round_end
        return [p.detach() for p in self._params]

    @torch.no_grad()
    def hold_round_end(self, *, eager: bool) -> None:
        """The round's payload is out; inner steps go on before its outer step. θ as the round
        ended is kept: the outer step is made of it when it comes. The steps go on from a
        start S and the step lands under what they added: θ ← φ' (− the encoding's residual)
        + (θ − S), as if it had come on time and those steps had followed it from there (the
        staleness of overlapping: their gradients taken at S, not at φ'). ``eager``: S is our
        own outer step alone, our Δ as sent standing in for the mean (eager updates, arXiv
        2502.12996): nearer φ' than θ_end, which it is otherwise (the local baseline's φ'
        is θ_end). Two more copies of the outer weights while it lasts (θ_end and S)."""
        self._round_end = [p.detach().clone() for p in self._params]
        if not eager:
            self._overlap_start = [t.clone() for t in self._round_end]
            return
        start = []
        parts = zip(self._params, self.phi, self.momentum, self.own_delta(), self._residual_parts(), strict=True)
        for param, phi, m, d, left in parts:
            s = phi + (self.outer.alpha * m - self.outer.beta * d)
            if left is not None:
                s -= left
            param.copy_(s)
            start.append(s)
        self._overlap_start = start

    def round_end_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint takes of the round's end when its outer step lands later: AdamW's
        moments then, and the overlapped steps' start S (``overlap_start.<k>``; the step count
        is the caller's). With the outer step's result (``state``), a restart takes the
        overlapped steps again from S and lands the same step on them, bit for bit
        (``restore``, ``land``)."""
        assert self._overlap_start is not None, "hold_round_end() first"
        tensors, _ = self.state()
        kept = {name: t for name, t in tensors.items() if name.startswith("adam.")}
        kept.update({f"overlap_start.{k}": t for k, t in enumerate(self._overlap_start)})
        return kept

    @property
    def landing(self) -> bool:
        """Restored from a checkpoint written mid-overlap: θ is the overlapped steps' start,
        and the outer step (φ, m, the residual restored) lands after them (``land``)."""
        return self._landing

    @torch.no_grad()
    def land(self) -> None:
        """The restored outer step onto the steps taken since the overlap's start."""
        assert self._landing
        self._landing = False
        self._load_phi_into_theta()

    @torch.no_grad()
    def outer_payload(self) -> torch.Tensor:
        """φ then Δ as wire bytes (uint8, ``payload_nbytes``): what a partner needs from us."""
        if self._wire is not None:  # once a round: an encoding's state (error feedback) moves on each call
            return self._wire
        wire, seen = self.encoding.encode(
            self._exact_flat(), self._numels, round_index=self.round, state=self.codec_state
        )
        self._sent = None if seen is None else self._split(seen)
        self._sent_flat = seen
        self._wire = wire
        return wire

    @torch.no_grad()
    def export_into(self, out: torch.Tensor) -> None:
        """This round's payload into ``out`` (the outbox: uint8, ``payload_nbytes``). A
        float32 payload on a GPU goes from the device straight into it: one copy over the
        bus into page-locked memory, where ``outer_payload`` makes a pageable host copy that
        is then copied again (29 ms for gpt-125m on the H200 either way before: the second
        copy ~10 ms of it). Every other case copies ``outer_payload``'s bytes in."""
        lossless = not self.encoding.lossy and self.payload_nbytes == 4 * self.payload_numel
        if lossless and self.device.type == "cuda" and type(self).outer_payload is Trainer.outer_payload:
            out.view(torch.float32).copy_(self._exact_flat())  # the same bytes: float32, little-endian
            return
        out.copy_(self.outer_payload())

    def _exact_flat(self) -> torch.Tensor:
        """φ then Δ, exactly, as one float32 tensor: what a payload encodes."""
        delta = outer_gradient(self.phi, self.theta())
        return torch.cat([t.reshape(-1) for t in (*self.phi, *delta)]).to(torch.float32)

    def parse_payload(self, wire: torch.Tensor) -> PeerTensors:
        """A partner's wire bytes as tensors shaped like ours; ``PayloadRejected`` if unusable."""
        peer, pending = self._read_payload(wire)
        self._judge_payload(pending.tolist())
        return peer

    def _read_payload(self, wire: torch.Tensor) -> tuple[PeerTensors, torch.Tensor]:
        """``parse_payload`` up to its verdict: the partner's tensors, and what the checks
        judge by, still on the device (``_judge_payload`` reads it: [all finite, then
        ``partner_norms``]). On a GPU the copy from the (page-locked) inbox is queued without
        a wait, and so is everything after it until the caller reads: the host queues the
        checks (and ``apply_noloco`` its step) while the copy runs (18 ms of a 1 GB payload
        on the H200). ``wire`` must stay as it is until then (the daemon writes the inbox
        again only after our outer_done)."""
        if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != self.payload_nbytes:
            raise PayloadRejected(
                f"payload is {wire.dtype} × {tuple(wire.shape)}, expected uint8 × ({self.payload_nbytes},)"
            )
        # aligned, and the caller's buffer is never kept
        wire = wire.to(self.device, copy=True, non_blocking=self.device.type == "cuda")
        # Our own as sent fills in what a payload leaves out (sparseloco); exactly, when
        # nothing was sent yet. A lossless payload leaves nothing out.
        fill = self._sent_flat
        if fill is None and self.encoding.lossy:
            fill = self._exact_flat()
        try:
            flat = self.encoding.decode(wire, self._numels, fill=fill)
        except ValueError as exc:
            raise PayloadRejected(str(exc)) from exc
        peer = self._split(flat)
        # Measured against our Δ as we sent it: a partner's is the same kind of thing
        # (sparseloco: a sparse Δ carrying its error feedback, int8: rounded).
        (finite,) = finite_flags([flat])
        return peer, torch.cat([finite.float().view(1), partner_norms(self.phi, self.own_delta(), peer)])

    def _judge_payload(self, values: list[float]) -> None:
        """``PayloadRejected`` unless ``_read_payload``'s numbers, read, pass: every value
        finite, then ``judge_partner``'s bounds."""
        if not values[0]:
            raise PayloadRejected("payload holds NaN or Inf")
        scale = self.inner.steps_per_round / max(1, min(self.steps_this_round, self.inner.steps_per_round))
        try:
            judge_partner(values[1:], [p.numel() for p in self.phi], self.bounds, scale=scale)
        except PartnerRefused as exc:
            raise PayloadRejected(str(exc), drifted=exc.drifted) from exc

    def own_delta(self) -> Params:
        """Our Δ as partners saw it this round (dequantized when compressed)."""
        return outer_gradient(self.phi, self.theta()) if self._sent is None else self._sent.delta

    def _split(self, flat: torch.Tensor) -> PeerTensors:
        parts = list(torch.split(flat, self._numels))
        shaped = [
            part.view_as(ref).to(ref.device, ref.dtype) for part, ref in zip(parts, [*self.phi, *self.phi], strict=True)
        ]
        return PeerTensors(phi=shaped[: len(self.phi)], delta=shaped[len(self.phi) :])

    @torch.no_grad()
    def apply_local(self) -> None:
        """The "local" baseline's outer step: none (φ follows θ)."""
        self.phi = [t.clone() for t in self.theta()]
        self.codec_state.pop("residual", None)  # φ took all of θ: nothing is left to send
        self._end_round()

    @torch.no_grad()
    def apply_noloco(self, peer_wire: torch.Tensor | None) -> bool:
        """NoLoCo's outer step with one partner's payload (or alone), then θ ← φ. Returns
        whether the partner's payload was used: a rejected one means the no-partner step,
        and ``last_rejection`` says why. The step with the partner is queued before its
        checks are read, with them in one read from the device (the step is a pure
        function: nothing changes until the verdict; a refused payload's step is dropped)."""
        self.last_rejection = None
        self.last_rejection_drifted = False
        peer: PeerTensors | None = None
        if peer_wire is not None:
            try:
                peer, pending = self._read_payload(peer_wire)
            except PayloadRejected as exc:
                self._rejected(exc)
        if peer is None:
            return self._step_alone()
        if self.encoding.lossy and self._sent is None:
            try:  # a refusal first, as before the step was queued ahead of the verdict
                self._judge_payload(pending.tolist())
            except PayloadRejected as exc:
                self._rejected(exc)
                del peer, pending  # the refused payload's tensors, before the step's
                return self._step_alone()
            raise RuntimeError("a compressed outer step needs outer_payload() first: the partner averages it")
        phi, momentum = noloco_step(self.phi, self.theta(), self.momentum, peer, self.outer, sent=self._sent)
        flags = finite_flags(phi)
        values = torch.cat([pending, *(flag.float().view(1).to(pending.device) for flag in flags)]).tolist()
        try:
            self._judge_payload(values[: len(pending)])
        except PayloadRejected as exc:
            self._rejected(exc)
            del phi, momentum, peer  # the refused step's tensors, before the other step's
            return self._step_alone()
        if not all(values[len(pending) :]):
            # Within the bounds and still non-finite (an overflow): the partner's share is dropped.
            self.last_rejection = "the outer step with its payload gives non-finite weights"
            del phi, momentum, peer  # the dropped step's tensors, before the other step's
            return self._step_alone()
        self._adopt(phi, momentum, used_peer=True, finite=True)
        return True

    def _step_alone(self) -> bool:
        """The no-partner step (no payload, or its step refused): False, the partner unused."""
        phi, momentum = noloco_step(self.phi, self.theta(), self.momentum, None, self.outer)
        self._adopt(phi, momentum, used_peer=False)
        return False

    def _rejected(self, exc: "PayloadRejected") -> None:
        self.last_rejection = str(exc)
        self.last_rejection_drifted = exc.drifted

    def _adopt(self, phi: Params, momentum: Params, *, used_peer: bool, finite: bool = False) -> None:
        """The outer step's result becomes ours; ``finite``: φ was checked already."""
        self.phi, self.momentum = phi, momentum
        if not used_peer:
            # Alone, the step took our whole Δ, what the payload left out included: θ
            # restarts from φ, or the residual would be stepped on twice (sparseloco).
            self.codec_state.pop("residual", None)
        self._end_round(finite=finite)

    @torch.no_grad()
    def apply_diloco(self, deltas: list[list[torch.Tensor]]) -> None:
        """DiLoCo baseline: ``deltas`` are every live node's Δ, ours included, in agreed order."""
        self.phi, self.momentum = diloco_step(self.phi, deltas, self.momentum, self.outer)
        self._end_round()

    def _end_round(self, *, finite: bool = False) -> None:
        if self._wire is None:  # no payload this round: the outer step took our whole Δ
            self.codec_state.pop("residual", None)
        self._load_phi_into_theta(finite=finite)
        self.round += 1
        self._sent = None
        self._sent_flat = None
        self._wire = None

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything a restart needs, taken between rounds: φ, m, AdamW's moments, and the
        encoding's state (θ = φ then, or φ − the encoding's residual: restored from it)."""
        tensors: dict[str, torch.Tensor] = {}
        for k, param in enumerate(self._params):
            tensors[f"phi.{k}"] = self.phi[k]
            tensors[f"momentum.{k}"] = self.momentum[k]
            adam = self.optimizer.state.get(param)
            if adam:
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    tensors[f"adam.{key}.{k}"] = torch.as_tensor(adam[key], dtype=torch.float32)
        for name, value in self.codec_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"encoding.{name}"] = value
        return tensors, {"round": self.round, "step": self.step}

    @torch.no_grad()
    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Adopt a saved ``state``; ``CheckpointError`` (and nothing changed) if it does not fit."""
        round_index, step = meta.get("round"), meta.get("step")
        if not (isinstance(round_index, int) and isinstance(step, int) and round_index >= 0 and step >= 0):
            raise CheckpointError("checkpoint has no valid round and step")
        overlapped = meta.get("overlapped", 0)
        if not (type(overlapped) is int and 0 <= overlapped <= self.inner.steps_per_round):
            raise CheckpointError(f"checkpoint's overlapped steps {overlapped!r} are not of a round")
        round_steps = meta.get("round_steps", self.inner.steps_per_round)
        if not (type(round_steps) is int and 1 <= round_steps <= self.inner.steps_per_round):
            raise CheckpointError(f"checkpoint's next round of {round_steps!r} steps is not of this run")
        adam: dict[int, dict[str, torch.Tensor]] = {}
        for k, param in enumerate(self._params):
            for key in ("phi", "momentum"):
                saved = tensors.get(f"{key}.{k}")
                if saved is None or saved.shape != param.shape or saved.dtype != param.dtype:
                    raise CheckpointError(f"checkpoint's {key}.{k} does not fit this model")
            found = {key: tensors.get(f"adam.{key}.{k}") for key in ("step", "exp_avg", "exp_avg_sq")}
            moments = {key: m for key, m in found.items() if m is not None}
            if not moments:
                continue  # this parameter has not been stepped yet
            if len(moments) != len(found) or any(
                m.shape != (() if key == "step" else param.shape)
                or m.dtype != (torch.float32 if key == "step" else param.dtype)
                for key, m in moments.items()
            ):
                raise CheckpointError(f"checkpoint's optimizer state {k} does not fit this model")
            adam[k] = moments
        starts = [tensors.get(f"overlap_start.{k}") for k in range(len(self._params))]
        if any(e is not None for e in starts) and not all(
            e is not None and e.shape == p.shape and e.dtype == p.dtype
            for e, p in zip(starts, self._params, strict=True)
        ):
            raise CheckpointError("checkpoint's overlap_start does not fit this model")
        if not all_finite_each(tensors.values()):
            raise CheckpointError("checkpoint holds NaN or Inf")
        self.phi = [tensors[f"phi.{k}"].to(self.device, copy=True) for k in range(len(self._params))]
        self.momentum = [tensors[f"momentum.{k}"].to(self.device, copy=True) for k in range(len(self._params))]
        self.optimizer.state.clear()
        for k, state in adam.items():
            # AdamW keeps its step count on the CPU unless capturable; the moments live with the weights.
            self.optimizer.state[self._params[k]] = {
                key: m.clone() if key == "step" else m.to(self.device, copy=True) for key, m in state.items()
            }
        self.round, self.step = round_index, step
        self._round_end, self._overlap_start, self._landing = None, None, False
        self.landing_steps = 0
        self.next_round_steps = round_steps
        self._sent = None
        self._sent_flat = None
        self._wire = None
        # The encoding's state, where it fits (a Δ's worth each; else it starts afresh).
        fits = (self.payload_numel // 2,)
        self.codec_state = {
            name.removeprefix("encoding."): value.to(self.device, copy=True)
            for name, value in tensors.items()
            if name.startswith("encoding.") and value.dtype == torch.float32 and value.shape == fits
        }
        if not starts or starts[0] is None:
            self._load_phi_into_theta()
            return
        # Written mid-overlap: θ at the overlapped steps' start; the step lands after them.
        self._overlap_start = [e.to(self.device, copy=True) for e in starts if e is not None]
        for param, start in zip(self._params, self._overlap_start, strict=True):
            param.copy_(start)
        self._landing, self.landing_steps = True, overlapped

    def _residual_parts(self) -> list[torch.Tensor | None]:
        """The encoding's residual (what the payload left out of Δ: sparseloco) cut into one
        part per outer parameter, shaped like it; Nones without one."""
        residual = self.codec_state.get("residual")
        if residual is None:
            return [None] * len(self.phi)
        parts = torch.split(residual, self._numels[: len(self.phi)])
        return [part.view_as(phi) for part, phi in zip(parts, self.phi, strict=True)]

    def _load_phi_into_theta(self, *, finite: bool = False) -> None:
        # Checked before θ takes them (unless the caller just did: ``finite``): non-finite
        # weights (our own divergence) end this worker before anything is saved, and its
        # successor resumes from the last good checkpoint.
        if not finite and not all_finite_each(self.phi):
            raise FloatingPointError("outer step produced non-finite weights")
        # What the payload left out of Δ stays in θ (sparseloco): θ ← φ − (Δ − sent).
        starts, self._overlap_start, self._round_end = self._overlap_start, None, None
        parts = self._residual_parts()
        if starts is None and all(left is None for left in parts):
            params: list[torch.Tensor] = list(self._params)
            torch._foreach_copy_(params, self.phi)  # one list op (~150 copies for gpt-125m)
            return
        for k, (param, phi, left) in enumerate(zip(self._params, self.phi, parts, strict=True)):
            target = phi if left is None else phi - left
            if starts is None:
                param.copy_(target)
            elif not torch.equal(starts[k], target):  # the steps since the overlap's start stay
                param.sub_(starts[k]).add_(target)  # θ ← target + (θ − S)
            # else the step is where the steps started (the local baseline's φ' = S): θ stays,
            # where θ − S + φ' would round it
