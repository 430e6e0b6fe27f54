"""Exported models run by ONNX Runtime in ``vision-attn predict`` (:class:`OnnxPredictor`).

An ONNX file is data like a checkpoint: its vision_attn metadata goes through the checks a
checkpoint's does (:func:`~vision_attn.tasks.base.build_task_from_meta`, the preprocessing's types
and sizes), and ONNX Runtime runs its graph with an arena of at most ``VISION_ATTN_MAX_ONNX_BYTES``
(default 4 GiB): a graph of a few bytes that asks for gigabytes (a ``ConstantOfShape`` of a huge
shape) fails with a clear error instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

from vision_attn.errors import CheckpointError, VisionAttnError
from vision_attn.schema import PreprocessOverrides, check_data_size, check_limits, check_value, human_bytes, parse_bytes
from vision_attn.tasks.base import build_task_from_meta

__all__ = ["DEFAULT_MAX_ONNX_BYTES", "ONNX_MEMORY_ENV", "OnnxPredictor", "max_onnx_bytes"]

ONNX_MEMORY_ENV = "VISION_ATTN_MAX_ONNX_BYTES"
DEFAULT_MAX_ONNX_BYTES = 4 << 30
_registered: list[int] = []  # the arena cap given to ONNX Runtime in this process


def max_onnx_bytes() -> int:
    """The bound of :data:`ONNX_MEMORY_ENV` (default 4 GiB) on what ONNX Runtime may allocate."""
    raw = os.environ.get(ONNX_MEMORY_ENV, "").strip()
    return parse_bytes(raw, ONNX_MEMORY_ENV) if raw else DEFAULT_MAX_ONNX_BYTES


def _capped_options(ort: Any) -> Any:
    """Session options whose CPU allocations come from one arena of at most :func:`max_onnx_bytes`
    (registered with ONNX Runtime's environment once per process and cap)."""
    cap = max_onnx_bytes()
    if cap not in _registered:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(cap, 0, -1, -1))
        _registered[:] = [cap]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options


class OnnxPredictor(L.LightningModule):
    """An exported model run by ONNX Runtime in Lightning's predict loop. Its records come from
    the task its metadata describes (:meth:`~vision_attn.tasks.VisionTask.predictions_from_outputs`,
    which needs the labels, not the weights); ONNX holds no attention, so no overlays."""

    def __init__(self, path: Path, allow_import: tuple[str, ...] = ()) -> None:
        super().__init__()

        try:
            import onnxruntime as ort
        except ImportError as err:  # pragma: no cover - depends on the install
            raise VisionAttnError("running .onnx models needs onnxruntime: pip install 'vision_attn[export]'") from err
        self.path = path
        try:  # ONNX Runtime's errors derive from Exception only: make them one clear line
            self.session = ort.InferenceSession(str(path), _capped_options(ort), providers=["CPUExecutionProvider"])
            meta = self.session.get_modelmeta().custom_metadata_map
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"ONNX Runtime cannot load {path}: {_first_line(err)}; "
                                  "export it again with vision-attn export") from err
        if meta.get("format") != "vision_attn":
            raise CheckpointError(f"{path} was not exported by vision_attn (no metadata); use vision-attn export")
        what = f"ONNX model {path}"
        try:
            stored = json.loads(meta["data_config"])
            model = json.loads(meta["model"])
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            raise CheckpointError(f"{path} has broken vision_attn metadata ({type(err).__name__}: {err}); "
                                  "export it again with vision-attn export") from err
        check_data_size({"data_config": stored, "model": model}, what)  # as read_task_meta checks a checkpoint's
        check_value(stored, PreprocessOverrides, "data_config", what)
        check_limits(stored, what, "data_config")
        if "input_size" not in stored:
            raise CheckpointError(f"{what}: its data_config has no input_size; export it again with vision-attn export")
        data_config = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()}
        task = build_task_from_meta({"model": model}, what, allow_import)
        if not task.onnx_predicts:
            raise CheckpointError(f"{path} holds a {task.task_name} model whose predictions need PyTorch "
                                  "(e.g. beam search); predict with the checkpoint instead")
        task.encoder.data_config = data_config
        self.task = task.eval()
        self.task_name = task.task_name
        self.predict_options = None

    def inference_data_config(self) -> dict[str, Any]:
        return self.task.inference_data_config()

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        files = batch["files"]
        records: list[dict[str, Any]] = []
        if files:
            try:
                outputs = self.session.run(None, {"images": batch["images"].cpu().numpy()})
            except Exception as err:  # noqa: BLE001 - ONNX Runtime's errors derive from Exception only
                over = "Available memory of" in str(err)
                raise CheckpointError(
                    f"ONNX Runtime failed running {self.path} on a batch of shape {tuple(batch['images'].shape)}: "
                    + (f"it needs more memory than {ONNX_MEMORY_ENV} allows ({human_bytes(max_onnx_bytes())}); "
                       "raise it if you trust the file, or lower --batch_size" if over else _first_line(err))) from err
            records = self.task.predictions_from_outputs(tuple(torch.from_numpy(o) for o in outputs), batch["sizes"],
                                                         self.predict_options)
        return {"files": files, "records": records, "panels": [None] * len(files),
                "report_items": [None] * len(files), "skipped": batch["skipped"]}


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__
