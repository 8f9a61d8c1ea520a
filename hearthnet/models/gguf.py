"""GGUF → safetensors, streamed tensor by tensor, so import memory stays near one tensor.

A GGUF's tensors are memory-mapped by gguf-py's `GGUFReader`; each one is de-quantised
(`gguf.dequantize`), put in transformers' layout by transformers' own per-architecture
`TensorProcessor` (e.g. Llama's q/k un-permutation) and name map, cast to the target dtype
(bf16 by default) and written (`SafetensorsWriter`) before the next is read: peak memory is
about one tensor in fp32. The config and tokenizer come from transformers' GGUF metadata
readers. Checks happen before any tensor work: the architecture must map to a transformers
decoder family, and every tensor's quantisation type must be one gguf-py can de-quantise.

With kept blocks (`dtype` None: `models import … --dtype gguf`, DESIGN.md decisions 10
and 15) nothing is de-quantised: every tensor whose processor is a permutation of rows
(the identity, or Llama's q/k un-permutation — found by running the processor on the row
indices) is written as the file has it, rows permuted: F32 and F16 tensors as F32 and
F16, quantised ones as their raw GGML blocks, a uint8 tensor (rows, bytes per row) with
the GGML type and logical shape in the file's `__metadata__`
(`hashing.GGML_METADATA`). A tensor whose processor computes (Gemma's norm − 1) is
de-quantised, processed and written in fp32. The store is then about the GGUF's size;
config.json says float32, the dtype the blocks de-quantise to (the `native` format).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hearthnet.errors import BadRequest, ModelStoreError
from hearthnet.models.writer import SafetensorsWriter, TensorPlan, WrittenModel

Progress = Callable[[int], None]


class GgufPlan:
    """What a GGUF file holds, checked: config, HF tensor plan, GGUF tensor per HF name.

    `check_architecture(gguf, arch)` refuses an architecture we do not import, right after
    the file's metadata is read (once: every GGUF read parses the whole vocabulary)."""

    def __init__(self, gguf: Path, dtype: torch.dtype | None,
                 check_architecture: Callable[[Path, str], None]) -> None:
        """`dtype`: what every tensor is de-quantised to; None keeps the file's own (blocks)."""
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import _type_traits
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            GGUF_SUPPORTED_ARCHITECTURES,
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        try:
            self.reader = GGUFReader(str(gguf))
            arch = str(self.reader.fields["general.architecture"].contents())
        except Exception as e:  # gguf-py raises whatever numpy does on a malformed file
            raise BadRequest(f"{gguf.name}: not a readable GGUF file "
                             f"({type(e).__name__}: {e})"[:300]) from e
        check_architecture(gguf, arch)
        if arch not in GGUF_SUPPORTED_ARCHITECTURES:  # an older transformers than ours
            raise ModelStoreError(f"{gguf}: this transformers cannot read GGUF architecture "
                                  f"{arch!r}; import the model's Hugging Face folder instead")
        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
        bad = sorted({t.tensor_type.name for t in self.reader.tensors
                      if t.tensor_type not in plain and t.tensor_type not in _type_traits})
        if bad:
            raise ModelStoreError(f"{gguf}: quantisation type(s) {', '.join(bad)} cannot be "
                                  f"de-quantised by gguf-py; convert the model to Q8_0, Q4_0, "
                                  f"Q4_K … or import its Hugging Face folder instead")
        try:
            load: Callable[..., Any] = load_gguf_checkpoint  # untyped in transformers
            parsed = load(str(gguf), return_tensors=False)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelStoreError(f"{gguf}: unreadable GGUF metadata ({e})") from e
        cfg_dict = dict(parsed["config"])
        try:
            self.config = AutoConfig.for_model(**cfg_dict)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.config)  # type: ignore[no-untyped-call]
        except (ValueError, KeyError) as e:
            raise ModelStoreError(f"{gguf}: GGUF architecture {arch!r} has no transformers "
                                  f"causal-LM family ({e})") from e
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(  # type: ignore[no-untyped-call]
            config=cfg_dict)
        self.parsed = parsed
        self.key_map: dict[str, str] = get_gguf_hf_weights_map(model, self.processor)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.plan: list[TensorPlan] = []
        self.source: dict[str, str] = {}
        self.rows: dict[str, Any] = {}  # kept tensors: HF name → row order (None: as is)
        for t in self.reader.tensors:
            hf = self.key_map.get(t.name)
            if hf is not None and hf in shapes:
                self.source[hf] = t.name
                self.plan.append(self._tensor_plan(t, hf, shapes[hf], dtype))
        self.plan.sort(key=lambda p: p.name)
        missing = sorted(set(shapes) - set(self.source) - _tied(self.config))
        if missing:
            raise ModelStoreError(f"{gguf}: GGUF architecture {arch!r} does not give every "
                                  f"tensor of {type(model).__name__} (missing {missing[:3]})")
        self.arch = arch

    def _tensor_plan(self, t: Any, hf: str, shape: tuple[int, ...],
                     dtype: torch.dtype | None) -> TensorPlan:
        """How tensor `t` is written: at `dtype`, or kept as the file has it (rows permuted
        by the processor) where `dtype` is None and the processor only permutes rows."""
        import numpy as np
        from gguf import GGMLQuantizationType

        plain = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
        if dtype is not None:
            return TensorPlan(hf, dtype, shape)
        rows = _row_order(self.processor, t.name, shape[0], self.key_map, self.parsed)
        blocks = len(shape) == 2 and t.tensor_type not in plain \
            and np.dtype(t.data.dtype) == np.uint8
        if rows is False or not (blocks or t.tensor_type in plain):
            return TensorPlan(hf, torch.float32, shape)  # de-quantised and processed
        self.rows[hf] = rows
        if not blocks:
            return TensorPlan(hf, plain[t.tensor_type], shape)
        return TensorPlan(hf, torch.uint8, (shape[0], t.data.size // shape[0]),
                          ggml_type=t.tensor_type.name, logical_shape=shape)

    def convert(self, writer: SafetensorsWriter, skip: set[str],
                progress: Progress | None) -> WrittenModel:
        """De-quantise, re-lay and write every planned tensor not in `skip`."""
        import numpy as np
        from gguf import dequantize

        for p in self.plan:
            if p.name in skip:
                pass
            elif p.name in self.rows:
                writer.write(p.name, self._kept(p))
            else:
                t = self.by_name[self.source[p.name]]
                res: Any = self.processor.process(  # type: ignore[no-untyped-call]
                    weights=dequantize(t.data, t.tensor_type), name=t.name,
                    tensor_key_mapping=self.key_map, parsed_parameters=self.parsed)
                w = torch.from_numpy(np.array(res.weights, dtype=np.float32))  # one tensor
                if tuple(w.shape) != p.shape:
                    w = w.reshape(p.shape)
                writer.write(p.name, w.to(p.dtype))
            if progress:
                progress(p.nbytes)
        return writer.close()

    def _kept(self, p: TensorPlan) -> torch.Tensor:
        """Tensor `p` as the file has it (blocks or F32/F16 values), rows in HF order."""
        import numpy as np

        t = self.by_name[self.source[p.name]]
        data = np.asarray(t.data).reshape(p.shape[0], -1)
        rows = self.rows[p.name]
        if rows is not None:
            data = data[rows]
        return torch.from_numpy(np.array(data, order="C")).reshape(p.shape)  # one tensor


def _row_order(processor: Any, name: str, n: int, key_map: dict[str, str],
               parsed: Any) -> Any:
    """The row order transformers' processor puts tensor `name` in (None: unchanged), or
    False where it does more than permute rows (then its values must be computed).

    The processor is run on the row indices (an (n, 1) array): a permutation comes back
    permuted, anything else does not come back as a permutation."""
    import numpy as np

    idx = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        res: Any = processor.process(weights=idx.copy(), name=name,
                                     tensor_key_mapping=key_map, parsed_parameters=parsed)
        out = np.asarray(res.weights, dtype=np.float64).reshape(-1)
    except (ValueError, TypeError, IndexError):
        return False
    if out.shape != (n,) or not np.array_equal(np.sort(out), idx.reshape(-1)):
        return False
    return None if np.array_equal(out, idx.reshape(-1)) else out.astype(np.int64)


def _tied(config: Any) -> set[str]:
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def save_config_and_tokenizer(gguf: Path, out: Path, model_id: str, dtype: torch.dtype,
                              config: Any) -> None:
    """config.json (no quantization section, the stored dtype), generation config and
    tokenizer files. `config`: the plan's, from the metadata it already read — what
    `AutoConfig.from_pretrained(gguf_file=…)` would read again."""
    import copy
    import json

    from transformers import AutoTokenizer, GenerationConfig

    cfg = copy.deepcopy(config)
    cfg.name_or_path = model_id
    cfg.save_pretrained(str(out))
    data = json.loads((out / "config.json").read_text())
    data.pop("quantization_config", None)  # plain from_pretrained has to work
    data.pop("torch_dtype", None)
    data["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    GenerationConfig.from_model_config(cfg).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        str(out))
