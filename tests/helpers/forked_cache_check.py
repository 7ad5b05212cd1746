"""Whatever transformers runs this script: the tiny Qwen2.5-VL's completions scored on each prompt's forked cache
(prompt-once) against whole sequences, and greedy tokens decoded on the forked cache (prefill-once: the decode loop
and `generate`) against `generate` prefilling every row. Prints one JSON line. Run by the vLLM environment's python
(transformers 5.19, before 5.24 renamed the cache keyword): tests/integration/test_vllm_real.py.

    python tests/helpers/forked_cache_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.gradients


def main() -> None:
    import transformers

    from gpg_vl import get_task
    from gpg_vl.models.cache import cache_keyword
    from gpg_vl.models.load import load_policy
    from gpg_vl.models.scoring import ScoringPath, token_logps
    from gpg_vl.rollout.engine import Sampling
    from gpg_vl.rollout.hf import DECODERS, generate
    from helpers.gradients import mixed_prompts

    torch.manual_seed(0)
    policy = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=50176)
    prompts = mixed_prompts(policy, get_task("shapes", train_size=8, test_size=4))
    group, width = 3, 7
    ids = torch.randint(20, 300, (3 * group, width), generator=torch.Generator().manual_seed(0))  # [N, C]
    mask = torch.arange(width)[None, :] < torch.tensor([7, 3, 5, 1, 7, 6, 2, 7, 4])[:, None]  # [N, C]
    index = [n // group for n in range(3 * group)]
    with torch.no_grad():
        plain = token_logps(policy.family, policy.model, prompts, index, ids, mask, path=ScoringPath())
        once = token_logps(policy.family, policy.model, prompts, index, ids, mask, path=ScoringPath(prompt_once=True))
    gap = (plain - once).abs()[mask]  # [tokens]
    greedy = Sampling(max_new_tokens=8, greedy=True)
    every_row = generate(policy, prompts.select([n // 2 for n in range(6)]), group_size=1, sampling=greedy,
                         prefill_once=False, decode="generate").completion_ids
    same = {decode: bool(torch.equal(generate(policy, prompts, group_size=2, sampling=greedy, prefill_once=True,
                                              decode=decode).completion_ids, every_row)) for decode in DECODERS}
    print(json.dumps({"transformers": transformers.__version__, "keyword": cache_keyword(policy.model),
                      "gap_mean": float(gap.mean()), "gap_max": float(gap.max()), "same_tokens": same}))


if __name__ == "__main__":
    main()
