"""`examples/agent_trajectories.py` in its reduced mode: one trajectory, one step."""

from __future__ import annotations

from _examples import load_example

# transformers' deprecation of the checkpointing names TRL's GRPOTrainer calls (`is_gradient_checkpointing`, ...)
TRL_CHECKPOINTING_ALIASES = (
    "is_gradient_checkpointing",
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
)


def test_decision_points_extend_each_other(capsys, recwarn):
    example = load_example("agent_trajectories")
    summary = example.main(["--steps", "1", "--trajectories", "1", "--actions", "2"])
    (step,) = summary["steps"]
    # three decision points of one trajectory in one batch: the first captured, the next two extend it
    assert (step["captures"], step["extends"]) == (1, 2)
    tokenizer = example.build_qwen3_6_tokenizer()
    prompts = example.decision_points(example.trajectories(1, 2)[0])
    lengths = [
        len(
            tokenizer.apply_chat_template(
                p, tools=[example.read_page], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]
    assert step["tokens_captured"] == lengths[-1]  # every token of the longest history prefilled once
    assert "prompt tokens prefilled" in capsys.readouterr().out
    # a run shows no FutureWarning for the deprecated names TRL calls
    aliases = [
        str(w.message) for w in recwarn if any(f"`{n}`" in str(w.message) for n in TRL_CHECKPOINTING_ALIASES)
    ]
    assert not aliases, aliases
