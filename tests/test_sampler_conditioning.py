"""PPO and Quark sample their rollouts behind the SFT folder's prompt conditioning (reward conditioning's
``<good>`` token), as generation does, and the trained policy keeps the conditioning file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from alpacafarm.prompts import CONDITIONING_FILE, PromptConditioning
from alpacafarm.testing import run_recipe, tiny_tokenizer, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INSTRUCTIONS = [{"instruction": f"Say something about topic {i}.", "input": "" if i % 2 else "briefly"}
                for i in range(4)]
STAGES = {  # one step / round over the four prompts; the reward model is any classifier head on the base
    "ppo": "{max_steps: 1, rollout_batch_size: 4, mini_batch_size: 4, per_device_train_batch_size: 4, "
           "generation_batch_size: 4, max_new_tokens: 3, save_strategy: 'no'}",
    "quark": "{rounds: 1, prompts_per_round: 4, rollouts_per_prompt: 2, top_quantile: 0.5, max_new_tokens: 3, "
             "generation_batch_size: 4, per_device_train_batch_size: 4, step_batch_size: 4, disable_tqdm: true}",
}


@pytest.mark.parametrize("method", sorted(STAGES))
@pytest.mark.parametrize("conditioned", [True, False], ids=["conditioned", "plain"])
def test_rollouts_are_sampled_behind_the_sft_folders_conditioning(
        method: str, conditioned: bool, tiny_model_dir: str, tmp_path: Path, generated_prompts: list[list[int]]):
    model = tmp_path / "sft"
    shutil.copytree(tiny_model_dir, model)
    if conditioned:
        PromptConditioning(prompt_prefix="<good>\n").save(model)
    instructions = write_records(tmp_path / "instructions.jsonl", INSTRUCTIONS)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: {method}-conditioning\nmodel: {{name: {model}}}\ndata:\n  prompts: {{path: {instructions}}}\n"
        f"stages:\n  - {{name: {method}, method: {method}, "
        f"inputs: {{instruction_splits: prompts, reward_model: base_model}}, config: {STAGES[method]}}}\n",
        encoding="utf-8")
    artifact = run_recipe(recipe, tmp_path / "run")[method]

    prefix = tiny_tokenizer()("<good>\n", add_special_tokens=False)["input_ids"]
    assert len(generated_prompts) == 4  # one row per prompt (generate repeats it for several rollouts)
    assert all((p[:len(prefix)] == prefix) is conditioned for p in generated_prompts)
    assert (Path(artifact.path) / CONDITIONING_FILE).is_file() is conditioned
    if conditioned:
        assert PromptConditioning.load(artifact.path) == PromptConditioning(prompt_prefix="<good>\n")
