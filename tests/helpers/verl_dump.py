"""verl 0.9.1's rollout dump writer, copied, so the traces tests write a `trainer.rollout_data_dir` file exactly as
verl does without verl installed: `PPOTrainer._write_generations` of verl/trainer/ppo/v1/trainer_base.py (the
legacy ray_trainer.py's differs only in `default=str`). tests/integrations/verl_plugin/test_verl_recipe.py checks,
where verl is installed, that verl's own writer produces the same bytes. Not a test module.
"""

from __future__ import annotations

import json
import os

import numpy as np


def write_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path, global_steps) -> str:
    """verl's `_write_generations`, line for line (its print dropped); returns the file written."""
    os.makedirs(dump_path, exist_ok=True)
    filename = os.path.join(dump_path, f"{global_steps}.jsonl")

    n = len(inputs)
    base_data = {
        "input": inputs,
        "output": outputs,
        "gts": gts,
        "score": scores,
        "step": [global_steps] * n,
    }

    for k, v in reward_extra_infos_dict.items():
        if len(v) == n:
            base_data[k] = v

    def json_encode_default(obj):
        if isinstance(obj, np.integer):
            return int(obj)
        elif isinstance(obj, np.floating):
            return float(obj)
        elif isinstance(obj, np.bool_):
            return bool(obj)
        elif hasattr(obj, "tolist"):
            return obj.tolist()
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    with open(filename, "w") as f:
        for i in range(n):
            entry = {k: v[i] for k, v in base_data.items()}
            f.write(json.dumps(entry, ensure_ascii=False, default=json_encode_default) + "\n")
    return filename


# Decoded texts as verl dumps them for Qwen2.5's chat template and hermes tool format: decoded with
# skip_special_tokens=True, so "<|im_start|>"/"<|im_end|>" are gone and their role words stay.
PROMPT = "system\nAnswer the question. You may call the `search` tool.\nuser\n{q}\nassistant\n"
CALL = '<tool_call>\n{{"name": "search", "arguments": {{"query": "{q}"}}}}\n</tool_call>\nuser\n'
OBS = "<tool_response>\n{doc}\n</tool_response>\nassistant\n"
