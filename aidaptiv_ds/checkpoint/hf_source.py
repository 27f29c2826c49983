"""Where a model to load comes from (``--model_name_or_path`` of the jobs and benchmarks).

Sources:

* a local HF directory (``config.json`` + ``*.safetensors``/``*.bin`` + tokenizer files);
* a ``.gguf`` file, loaded with ``from_pretrained(dir, gguf_file=name)``: transformers de-quantizes
  the weights into ordinary tensors of the requested dtype;
* a hub id (``org/name``), where the network allows.

Shared by the fine-tuning job (:mod:`aidaptiv_ds.finetune.model_io`), the generation job
(:mod:`aidaptiv_ds.cli.generate`) and the inference benchmarks; nothing here imports DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class ModelSource:
    """Where a model comes from.

    Attributes:
        path: directory or hub id handed to ``from_pretrained``.
        gguf_file: file name inside ``path`` for a GGUF checkpoint, else None.
        kind: ``"local"``, ``"gguf"`` or ``"hub"``.
    """
    path: str
    gguf_file: str | None
    kind: str

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_source(name_or_path: str) -> ModelSource:
    """Classify ``--model_name_or_path``.

    Raises:
        FileNotFoundError: a ``.gguf`` path or a path-like value (absolute, ``./``, ``../``, ``~``)
            that does not exist, or a directory without ``config.json``.
    """
    expanded = os.path.expanduser(name_or_path)
    if expanded.lower().endswith(".gguf"):
        if not os.path.isfile(expanded):
            raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: no such GGUF file")
        return ModelSource(os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded), "gguf")
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: the directory has no config.json; give an "
                                    f"HF model directory (config.json, *.safetensors, tokenizer files) or a .gguf file")
        return ModelSource(os.path.abspath(expanded), None, "local")
    if os.path.isabs(expanded) or name_or_path.startswith((".", "~")) or os.path.exists(expanded):
        raise FileNotFoundError(f"--model_name_or_path {name_or_path!r}: no such directory; give an HF model "
                                f"directory, a .gguf file or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    return ModelSource(name_or_path, None, "hub")


def _hub_error(src: ModelSource, what: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"--model_name_or_path {src.path!r}: not a local directory or .gguf file, and loading the "
                        f"{what} from the Hugging Face hub failed ({type(e).__name__}: {e}); without network, download "
                        f"the model elsewhere and pass its directory")


def load_tokenizer(src: ModelSource):
    """``AutoTokenizer.from_pretrained`` for the source (GGUF tokenizers come from the GGUF metadata)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.path, **src.kwargs())
    except OSError as e:
        if src.kind == "hub":
            raise _hub_error(src, "tokenizer", e) from e
        raise
