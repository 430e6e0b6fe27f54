"""Export a trained checkpoint: weights as ``.safetensors`` (plain tensors, no pickled code) or
the model as ONNX.

    vision-attn export --ckpt_path runs/x/checkpoints/last.ckpt --output_dir out   # out/encoder.safetensors
    vision-attn export --ckpt_path ... --output_dir out --part model              # out/model.safetensors
    vision-attn export --ckpt_path ... --output_dir out --format onnx             # out/model.onnx

ONNX (chosen by the ``.onnx`` suffix): input ``images`` ``[batch, 3, H, W]`` normalised as the
model's preprocessing says (stored in the file's metadata with the labels or vocabulary), any
batch size. The export writes exactly one file, ``model.onnx`` (its weights inside); nothing is
left beside it, also when the export fails or is interrupted. Outputs: classification
``logits [B, C]``; detection ``pred_logits [B, Q, C(+1)]`` and ``pred_boxes [B, Q, 4]``
(cxcywh in [0, 1]); captioning the encoder's ``tokens [B, T, D]`` (beam search stays in PyTorch).

``--part encoder`` (default) writes the timm ViT's state dict — keys exactly as timm names
them, so ``create_encoder(NAME, weights_file=...)`` or timm itself can load it; ``--part model``
writes the whole task (encoder and head, keys as in the checkpoint's ``state_dict``). The
architecture, preprocessing and labels go into the file's metadata as JSON. An existing file is
never overwritten (a link in its place included); the file is written through a fresh temporary
file in the same folder and renamed (:func:`vision_attn.outputs.atomic_output`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from vision_attn.errors import ConfigError, RunExistsError, VisionAttnError
from vision_attn.explain.progress import Progress
from vision_attn.outputs import atomic_output
from vision_attn.tasks.base import load_task

__all__ = ["export_onnx", "export_safetensors"]

log = logging.getLogger(__name__)

ONNX_SINGLE_FILE_BYTES = 2**31 - 1  # protobuf's limit on one file


def _check_target(output: Path, overwrite: bool) -> None:
    if output.is_symlink() or (os.path.lexists(output) and not output.is_file()):
        raise RunExistsError(f"{output} is a link or not a regular file; refusing to write through it")
    if os.path.lexists(output) and not overwrite:
        raise RunExistsError(f"{output} already exists; refusing to overwrite it (choose another --output_dir, "
                             "or pass --overwrite)")


def export_safetensors(ckpt_path: str | Path, output: str | Path, part: str = "encoder", overwrite: bool = False,
                       allow_import: tuple[str, ...] = ()) -> Path:
    """Write the weights of ``ckpt_path`` to ``output`` (see the module docstring); returns the path."""
    from safetensors.torch import save_file

    output = Path(output)
    _check_target(output, overwrite)
    if part not in ("encoder", "model"):
        raise ValueError(f"--part must be 'encoder' or 'model', got {part!r}")
    task = load_task(ckpt_path, allow_import=allow_import)
    module = task.encoder.model if part == "encoder" else task
    tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    meta = task.checkpoint_meta()
    metadata = {"format": "vision_attn", "part": part, "task": str(meta.get("task")),
                "model": json.dumps(meta["model"]), "data_config": json.dumps(meta.get("data_config"))}
    with atomic_output(output) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    log.info("wrote %d tensors (%s) to %s", len(tensors), part, output)
    return output


class _OnnxGraph(torch.nn.Module):
    """The tensors-in, tensors-out part of a task that ONNX holds (the task's ``export_forward``)."""

    def __init__(self, task) -> None:
        super().__init__()
        self.task = task

    def forward(self, images: torch.Tensor):
        return self.task.export_forward(images)


def export_onnx(ckpt_path: str | Path, output: str | Path, opset: int = 18, overwrite: bool = False,
                allow_import: tuple[str, ...] = (), progress: bool | None = None) -> Path:
    """Write the model of ``ckpt_path`` as ONNX (see the module docstring); returns the path.

    The export's steps (loading the checkpoint, tracing the model, which takes the longest,
    adding the metadata, writing the file) are reported as they run
    (:class:`~vision_attn.explain.progress.Progress`: a bar on a terminal, log lines otherwise;
    ``progress=False``: none; ``None``: unless the ``vision_attn`` logger is quiet)."""
    try:
        import onnx
    except ImportError as err:  # pragma: no cover - depends on the install
        raise VisionAttnError("ONNX export needs the export extra: pip install 'vision_attn[export]'") from err

    output = Path(output)
    _check_target(output, overwrite)
    with Progress("ONNX export: loading the checkpoint", 4, "step", enabled=progress, log_every=0.0) as steps:
        return _export_onnx(ckpt_path, output, opset, allow_import, onnx, steps)


def _export_onnx(ckpt_path, output: Path, opset: int, allow_import: tuple[str, ...], onnx, steps: Progress) -> Path:
    task = load_task(ckpt_path, allow_import=allow_import).eval()
    if task.no_inference:
        raise ConfigError(f"checkpoint {ckpt_path}: no ONNX model, {task.no_inference} --format safetensors")
    steps.set_description(f"ONNX export: tracing the {task.task_name} model")
    steps.update()
    _, h, w = task.data_config["input_size"]
    example = torch.zeros(2, 3, int(h), int(w))
    # torch writes the graph (and, for large models, its weights as a side file) into a private
    # folder, removed whatever happens; the one file the export documents is then written atomically
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=output.parent) as work:
        graph = Path(work) / "model.onnx"
        torch.onnx.export(_OnnxGraph(task).eval(), (example,), str(graph), input_names=["images"],
                          output_names=list(task.export_output_names), dynamic_shapes=({0: torch.export.Dim("batch")},),
                          dynamo=True, opset_version=opset, verbose=False)
        steps.set_description("ONNX export: adding the metadata")
        steps.update()
        model = onnx.load(str(graph))  # with its weights, wherever torch put them
        meta = task.checkpoint_meta()
        for key, value in {"format": "vision_attn", "task": str(meta.get("task")), "model": json.dumps(meta["model"]),
                           "data_config": json.dumps(meta.get("data_config"))}.items():
            model.metadata_props.add(key=key, value=value)
        if model.ByteSize() >= ONNX_SINGLE_FILE_BYTES:
            raise VisionAttnError(f"the {task.task_name} model is {model.ByteSize() >> 20} MiB, beyond what one ONNX "
                                  "file holds (2 GiB); export the weights with --format safetensors instead")
        steps.set_description(f"ONNX export: writing {output.name}")
        steps.update()
        with atomic_output(output, suffix=".tmp.onnx") as tmp:
            onnx.save(model, str(tmp))
        steps.set_description(f"ONNX export: wrote {output.name}")
        steps.update()
    log.info("wrote the %s model as ONNX to %s", task.task_name, output)
    return output


if __name__ == "__main__":
    from vision_attn.commands.export import main

    main()
