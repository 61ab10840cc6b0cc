"""TensorBoard sink for the rank-0 ``RunLogger`` (Megatron's default): scalars, plans, figures.

    sink = TensorBoardSink.from_config(cfg, run_dir, is_writer=topo.rank == 0)   # None when off
    tensorboard --logdir runs/tiny/tensorboard

``logging.tensorboard = true`` writes event files to ``<run_dir>/tensorboard``: every scalar W&B
gets (``wandb_sink.scalars`` of each metrics record, ``wandb_sink.plan_scalars`` of each plan, at
the optimizer step), the resolved config as text, and the precision maps and the plan timeline
as images - the PNG files ``telemetry.plots`` wrote, stored byte for byte (no re-encoding). W&B's
tables (plan entries, costs) have no TensorBoard counterpart; they stay in ``plans/*.json``.

Optional: the ``tensorboard`` package (``pip install -e ".[tensorboard]"``) is imported lazily, on
the writing rank only; when it is missing, asking for it is a config error saying how to get it.
A resumed run appends new event files to the same folder; TensorBoard shows the later value for
a step logged twice (the steps after the checkpoint, re-run).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_snip.atomic_io import ensure_writable_dir
from megatron_snip.config import Config
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.telemetry.wandb_sink import plan_caption, plan_scalars, scalars

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


_COLORSPACE = {0: 1, 4: 2, 2: 3, 3: 3, 6: 4}  # PNG colour type -> TensorBoard's (grey, grey+alpha, RGB, RGBA)


def png_header(data: bytes, path: str | Path) -> tuple[int, int, int]:
    """(width, height, TensorBoard colorspace) from a PNG's IHDR chunk; ValueError naming ``path``
    if it is not a PNG."""
    if len(data) < 26 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR" or data[25] not in _COLORSPACE:
        raise ValueError(f"image {str(path)!r} is not a PNG file; write it with telemetry.plots")
    width, height = struct.unpack(">II", data[16:24])
    return width, height, _COLORSPACE[data[25]]


def check_log_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/tensorboard``, created and checked writable: ValueError naming it and the fix
    (a file there, or no write access), before any event file is opened. ``RunDirectory.check_fresh``
    calls it at start-up, where rank 0's verdict reaches every rank."""
    log_dir = Path(run_dir) / "tensorboard"
    return ensure_writable_dir(log_dir, "logging.tensorboard", what=f"config logging.tensorboard=true: {str(log_dir)!r}",
                               fix=f"move what is at {log_dir} away (the event files go there), or set "
                                   f"logging.tensorboard=false")


class TensorBoardSink:
    """Event files under ``<run_dir>/tensorboard``, written only by the rank that creates the sink.

    Args:
        run_dir: the run directory.
        config: the resolved config as a nested dict, recorded as text (``Config.to_dict()``).
    """

    def __init__(self, run_dir: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("config logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
                             "(or pip install -e \".[tensorboard]\"), or set logging.tensorboard=false") from None
        self._summary = Summary
        self.log_dir = check_log_dir(run_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            text = "\n".join(f"[{s}]\n" + "\n".join(f"{k} = {v!r}" for k, v in vals.items()) for s, vals in config.items())
            self.writer.add_text("config", f"```\n{text}\n```", 0)
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path | None = None, *, is_writer: bool) -> TensorBoardSink | None:
        """The sink ``cfg.logging.tensorboard`` asks for, or None (off, or not the writing rank)."""
        if not is_writer or not cfg.logging.tensorboard:
            return None
        return cls(run_dir if run_dir is not None else cfg.training.run_dir, config=cfg.to_dict())

    # --- RunLogger sink interface -----------------------------------------------------
    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Every scalar of ``record`` at ``step``, under the names W&B uses."""
        self._scalars(step, scalars(record))

    def close(self) -> None:
        """Flush and close the event file; safe to call twice."""
        if not self._closed:
            self._closed = True
            self.writer.close()

    # --- plans and figures ----------------------------------------------------------------
    def log_plan(self, plan: PrecisionPlan, png_path: str | Path | None = None,
                 costs: Mapping[Any, Mapping[str, float]] | None = None) -> None:
        """``plan``'s scalars (as W&B's ``log_plan``) and, when given, its precision map
        ``plan/map`` at ``plan.step``. ``costs`` (a W&B table) are not written here."""
        self._scalars(plan.step, plan_scalars(plan))
        if png_path is not None:
            self._image("plan/map", png_path, plan.step, plan_caption(plan))

    def log_final_plan(self, plan: PrecisionPlan, png_path: str | Path, step: int) -> None:
        """The final plan's map (``final/map``) and its FP4 share (``final/fp4_flops_share``) at ``step``."""
        self._scalars(step, {"final/fp4_flops_share": plan.fp4_flops_share})
        self._image("final/map", png_path, step, "final plan: " + plan_caption(plan))

    def log_timeline(self, png_path: str | Path, step: int | None = None) -> None:
        """The plan-timeline PNG (``plan/timeline``) at ``step`` (0 if not given)."""
        self._image("plan/timeline", png_path, step or 0, "")

    def _scalars(self, step: int, data: Mapping[str, float | int]) -> None:
        if self._closed:
            return
        for name, value in data.items():
            self.writer.add_scalar(name, value, step)

    def _image(self, tag: str, png_path: str | Path, step: int, caption: str) -> None:
        path = Path(png_path)
        if not path.is_file():
            raise ValueError(f"image {str(path)!r} does not exist; write it first (telemetry.plots)")
        if self._closed:
            return
        data = path.read_bytes()
        width, height, colorspace = png_header(data, path)
        image = self._summary.Image(height=height, width=width, colorspace=colorspace, encoded_image_string=data)
        summary = self._summary(value=[self._summary.Value(tag=tag, image=image)])
        self.writer.file_writer.add_summary(summary, step)
        if caption:
            self.writer.add_text(f"{tag}/caption", caption, step)
