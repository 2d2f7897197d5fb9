"""The bad-input table (docs/bad_inputs.md): every row is one case below, run here through ``codraft``'s entry point
as a user would type it, with the exit status and the message the page promises.

Most cases are refused by ``--dry-run`` (the config, then the checks before launch: data, rewards, files) in well
under a second; the ``run`` cases start a micro run that fails in its first RL step (a reward that only fails
there). ``python tests/test_bad_inputs.py`` rewrites the page from these cases; a test keeps the two equal.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "recipes" / "tiny-smoke.yaml")
PAGE = REPO / "docs" / "bad_inputs.md"
sys.path.insert(0, str(REPO / "tests" / "rl"))  # rewards_for_tests, importable by dotted path as a user's module

DATA = ["task.name=dataset", "task.prompt_column=question", "sft.steps=0", "task.heldout=1"]
"""A JSON Lines task of the user's own (``{tmp}/ok.jsonl`` unless a case names another file)."""
MICRO = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
         "sft.steps=0", "draft.warm_start.steps=0", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
         "rl.max_new_tokens=8", "task.eval_prompts=0", "run.progress=false", "run.out_dir={tmp}/run"]
"""A run of seconds (the ``run`` cases)."""
FILES = {
    "ok.jsonl": '{"question": "what is 1 plus 2", "answer": "3"}\n{"question": "and 2 plus 2", "answer": "4"}\n',
    "broken.jsonl": '{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n',
    "list_line.jsonl": '{"question": "a", "answer": "1"}\n["not", "an", "object"]\n',
    "no_answer.jsonl": '{"question": "a", "answer": "1"}\n{"question": "b"}\n',
    "empty.jsonl": "\n",
    "one_row.jsonl": '{"question": "what is 1 plus 2", "answer": "3"}\n',
    "accents.jsonl": '{"question": "combien font 1 et 2, café", "answer": "3"}\n{"question": "2", "answer": "2"}\n',
    "number_prompt.jsonl": '{"question": 12, "answer": "3"}\n{"question": 13, "answer": "4"}\n',
    "chat.jsonl": '{"question": [{"role": "user", "content": "1 plus 2"}], "answer": "3"}\n' * 2,
    "bad_chat.jsonl": '{"question": [{"role": "user"}], "answer": "3"}\n' * 2,
    "nowhere/note.txt": "not a run directory\n",
}


@dataclass
class Case:
    """One bad input: what a user types, the exit status, and a piece of the message that must be printed."""

    what: str
    """The bad input, in words (the page's first column)."""
    args: list[str]
    """Arguments after ``codraft`` (``{tmp}``: the case's directory, holding :data:`FILES`)."""
    exit: int
    """The promised exit status (2: refused before anything ran; 3: a reward failed during the run)."""
    message: str
    """Printed on stderr (``{tmp}`` substituted)."""
    run: bool = field(default=False)
    """A run case (seconds, not a fraction of one)."""


def dry(*overrides: str) -> list[str]:
    return ["fit", "--config", SMOKE, "--dry-run", *overrides]


def data(*overrides: str, file: str = "ok.jsonl") -> list[str]:
    return dry(*DATA, f"task.source={{tmp}}/{file}", *overrides)


def run(*overrides: str) -> list[str]:
    return ["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *MICRO, *overrides]


CASES = [
    # the command line and the recipe
    Case("a recipe file that does not exist", ["fit", "--config", "{tmp}/nope.yaml"], 2, "nope.yaml' does not exist"),
    Case("an override without `=`", dry("rl.steps"), 2, "override 'rl.steps' is not of the form key=value"),
    Case("an unknown key", dry("rl.lrr=1"), 2, "unknown config key 'rl.lrr'"),
    Case("an unknown section", dry("rll.steps=1"), 2, "unknown config key 'rll'"),
    Case("a value of the wrong type", dry("rl.steps=abc"), 2, "invalid config value at rl.steps"),
    Case("a wrong type inside a list entry", dry("task.rewards=[{fn: format_match, weight: abc}]"), 2,
         "invalid config value at task.rewards[0].weight"),
    Case("an unknown key inside a list entry", dry("task.rewards=[{fn: format_match, kwargz: {}}]"), 2,
         "unknown config key 'task.rewards[0].kwargz'"),
    Case("a negative learning rate", dry("rl.lr=-1"), 2, "rl.lr=-1.0 must be > 0"),
    Case("a negative speculation length", dry("draft.num_speculative_tokens=-1"), 2,
         "draft.num_speculative_tokens=-1 must be >= 0"),
    Case("a retired setting (`on_reward_error: warn`)", dry("task.on_reward_error=warn"), 2,
         "'warn' scored a failed reward 0"),
    Case("a choice that does not exist", dry("task.on_reward_error=ignore"), 2,
         "task.on_reward_error='ignore' is not one of"),
    Case("a negative `run.keep_checkpoints`", dry("run.keep_checkpoints=-1"), 2, "run.keep_checkpoints=-1 must be >= 0"),
    Case("a greedy temperature for GRPO", dry("rl.temperature=0"), 2,
         "rl.temperature=0.0 makes every sample of a group the same"),
    Case("an unknown logger", dry("run.loggers=[tensorbored]"), 2, "run.loggers[0]"),
    Case("`draft.reference` pointing nowhere", dry("draft.reference={tmp}/nowhere"), 2,
         "draft.reference='{tmp}/nowhere': no weights.pt there"),
    Case("`run.init_from` pointing nowhere", dry("run.init_from={tmp}/nowhere"), 2,
         "run.init_from='{tmp}/nowhere': no weights.pt there"),
    # the data
    Case("a data task without a source", dry("task.name=dataset", "sft.steps=0"), 2,
         "task.name=dataset needs source"),
    Case("a data file that does not exist", data(file="missing.jsonl"), 2, "missing.jsonl' does not exist"),
    Case("a line that is not valid JSON", data(file="broken.jsonl"), 2, "broken.jsonl:2: not valid JSON"),
    Case("a line that is not a JSON object", data(file="list_line.jsonl"), 2,
         "list_line.jsonl:2: a list, not a JSON object"),
    Case("a row without the answer column", data(file="no_answer.jsonl"), 2,
         "no_answer.jsonl:2 has no column 'answer'"),
    Case("a prompt column that does not exist", data("task.prompt_column=query"), 2, "has no column 'query'"),
    Case("a template naming a missing column", data("task.template='Q: {problem}'"), 2,
         "task.template 'Q: {problem}' names the column 'problem'"),
    Case("a data file without rows", data(file="empty.jsonl"), 2, "empty.jsonl: no rows"),
    Case("`task.limit: 0`", data("task.limit=0"), 2, "task.limit=0 must be >= 1"),
    Case("held-out rows that leave nothing to train on", data("task.heldout=5", file="one_row.jsonl"), 2,
         "task.heldout=5 holds out every one of the 1 rows"),
    Case("a prompt the tiny model's tokenizer cannot encode", data(file="accents.jsonl"), 2,
         "accents.jsonl:1: character 'é'"),
    Case("a prompt column holding numbers", data(file="number_prompt.jsonl"), 2,
         "column 'question' holds a value of type int (12), not a prompt text"),
    Case("chat messages (TRL's conversational column) and no chat template", data(file="chat.jsonl"), 2,
         "holds chat messages (TRL's conversational form) but the tokenizer"),
    Case("a chat message without `content`", data(file="bad_chat.jsonl"), 2,
         "message 0 is {'role': 'user'}; a chat message is"),
    Case("a template over a conversational column", data("task.template='{question}'", file="chat.jsonl"), 2,
         "task.template formats text, but column 'question' holds chat messages"),
    Case("SFT without worked solutions", data("sft.steps=3"), 2, "sft.steps=3 fine-tunes on worked solutions"),
    # the rewards, before launch
    Case("a reward whose module does not import", data("task.rewards=[{fn: 'no_such_pkg.rewards:score'}]"), 2,
         "cannot import module 'no_such_pkg.rewards'"),
    Case("a reward the module does not have", data("task.rewards=[{fn: 'rewards_for_tests:nothing_here'}]"), 2,
         "module 'rewards_for_tests' has no callable 'nothing_here'"),
    Case("a reward name that is neither built-in nor a path", dry("task.rewards=[{fn: exact}]"), 2,
         "task.rewards[0].fn='exact' is neither a built-in reward"),
    Case("`task.reward` and `task.rewards` both set",
         dry("task.reward=rewards_for_tests:flaky_reward", "task.rewards=[{fn: format_match}]"), 2,
         "task.reward and rewards are both set"),
    Case("an empty `task.rewards`", dry("task.rewards=[]"), 2, "task.rewards is empty"),
    Case("two rewards under one name", dry("task.rewards=[{fn: format_match}, {fn: format_match}]"), 2,
         "the name 'format_match' repeats"),
    Case("a non-finite reward weight", dry("task.rewards=[{fn: format_match, weight: .inf}]"), 2,
         "task.rewards[0].weight=inf must be a finite number"),
    Case("S4: a misspelt option of a built-in reward", dry("task.rewards=[{fn: length_penalty, kwargs: {max_charz: 1}}]"),
         2, "task.rewards[0].kwargs.max_charz: lightning_codraft.rl.tasks.reward_funcs:length_penalty has no option "
            "'max_charz' (did you mean 'max_chars'?)"),
    Case("S4: a misspelt option of your reward",
         dry("task.rewards=[{fn: 'rewards_for_tests:scaled_length', kwargs: {scal: 2}}]"), 2,
         "rewards_for_tests:scaled_length has no option 'scal'"),
    Case("S4: an option that is a column the run passes", dry("task.rewards=[{fn: format_match, kwargs: {answer: 1}}]"),
         2, "'answer' is what the run passes every reward"),
    Case("S5: no answer column and the built-in answer reward", data("task.answer_column=null"), 2,
         "the task's built-in reward (math_equivalence) scores against the reference answer, but "
         "answer_column is null"),
    Case("S5: no answer column and an answer reward", data("task.answer_column=null",
                                                          "task.rewards=[{fn: exact_answer}]"), 2,
         "task.rewards[0] (exact_answer) scores against the reference answer"),
    Case("a reward with a signature the run cannot call",
         data("task.rewards=[{fn: 'rewards_for_tests:two_args_reward'}]"), 2,
         "a one-sample call failed: raised TypeError"),
    Case("a batched (TRL) reward given as `task.reward`", dry("task.reward=rewards_for_tests:batched_reward"), 2,
         "looks like a batched (TRL-style) reward"),
    Case("a reward returning NaN", dry("task.reward=rewards_for_tests:nan_reward"), 2, "non-finite reward nan"),
    Case("S6: a reward returning None for every sample", dry("task.rewards=[{fn: 'rewards_for_tests:never_applies'}]"),
         2, "no reward function applies to it"),
    # during the run
    Case("S1: a batched reward that raises on batches only", run("task.rewards=[{fn: 'rewards_for_tests:batch_only_"
                                                                 "reward'}]"), 3,
         "the batched call on 4 samples raised RuntimeError: rate limit", run=True),
    Case("S1 with `task.on_reward_error: skip`", run("task.rewards=[{fn: 'rewards_for_tests:batch_only_reward'}]",
                                                     "task.on_reward_error=skip"), 3,
         "4 of the step's 4 samples failed", run=True),
    Case("a per-sample reward that raises on some prompts",
         run("task.reward=rewards_for_tests:flaky_reward", "rl.prompts_per_step=8"), 3,
         "reward function rewards_for_tests:flaky_reward failed on sample", run=True),
    # other commands
    Case("`codraft export` of a directory that is no run", ["export", "{tmp}/nowhere", "{tmp}/out"], 2,
         "is not a run directory: it has no config.yaml"),
    Case("`codraft plan` with a device memory it cannot read", ["plan", "--config", SMOKE, "--device-memory", "lots"],
         2, "--device-memory"),
]


def _materialise(tmp: Path) -> None:
    for name, text in FILES.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_each_bad_input_exits_as_the_page_says(case, tmp_path, capsys):
    from lightning_codraft.cli import main

    _materialise(tmp_path)
    code = main([a.replace("{tmp}", str(tmp_path)) for a in case.args])
    err = capsys.readouterr().err
    assert code == case.exit, err
    assert case.message.replace("{tmp}", str(tmp_path)) in err, err
    assert "Traceback" not in err


def table() -> str:
    """The page's table, from :data:`CASES`."""
    def show(args):
        return " ".join(a if " " not in a else repr(a) for a in args).replace("|", "\\|")

    rows = ["| # | bad input | command | exit | message (excerpt) |", "|---|---|---|---|---|"]
    for i, c in enumerate(CASES, 1):
        shown = [a.replace(str(REPO) + "/", "") for a in c.args]
        rows.append(f"| {i} | {c.what} | `codraft {show(shown)}` | {c.exit} | "
                    f"{c.message.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def test_the_page_lists_exactly_these_cases():
    text = PAGE.read_text()
    assert len(CASES) >= 40
    assert table() in text, "docs/bad_inputs.md is out of date: run `python tests/test_bad_inputs.py`"


if __name__ == "__main__":
    head = PAGE.read_text().split("| # | bad input", 1)[0] if PAGE.exists() else "# Bad inputs\n\n"
    PAGE.write_text(head + table())
    print(f"wrote {PAGE} ({len(CASES)} cases)")
