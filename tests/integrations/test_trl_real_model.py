"""The TRL path with a real model's kind of tokenizer: a tiny Qwen2 built from a config, a byte-level BPE trained on the
task text (no unk token, no bos, ChatML chat template), conversational prompts (examples/trl/rapo_grpo_chat.py).

Each silent trap of a user bringing their own model has a test: tags that are not single tokens are refused at
construction with the add_rapo_tags remedy; chat prompts are tokenized as TRL tokenizes them and tool output sits in
the template's tool turn, out of the loss; evaluate() neither retrieves nor grows the buffer; TRL checkpoints carry the
buffer and a resume restores it exactly; sampling options the rollout does not implement are refused; a StepBuffer
passed as traces is refused at construction; the TRL path's names import from one module. End to end: 2 steps with
retrieval, retrieved tokens out of the loss, the buffer grown.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except Exception as exc:  # ImportError, or any error raised while trl imports its own needs
    pytest.skip(f"trl integration needs trl and its imports: {exc!r}"[:300], allow_module_level=True)

from rapo_fast.demo.tiny_qwen import CHATML_TEMPLATE, build_tiny_qwen  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL


def _example():
    spec = importlib.util.spec_from_file_location("rapo_grpo_chat", ROOT / "examples" / "trl" / "rapo_grpo_chat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = _example()
TASK = EX.make_task(EX.parse_args([]))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model on one thread, as the example runs it: more only wait on each other on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def torch_loss_path():
    """rapo_loss on its torch path, as on a CPU without the interpreter: under TRITON_INTERPRET=1 the Triton kernels
    run in Triton's interpreter, most of this module's time (the 2-step run: minutes), and this module is about the
    tokenizer, the chat template, the rollout and the buffer, not the kernels (tests/loss; the kernels' loss and
    gradients against TRL's own: test_integration_trl.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAPO_FAST_DISABLE_TRITON", "1")
        yield


@pytest.fixture(scope="module")
def raw():
    """(model, tokenizer) as built, before add_rapo_tags: the tags are split into byte-level pieces."""
    problems = TASK.make_problems(50, seed=5)
    return build_tiny_qwen([CHATML_TEMPLATE] + [" ".join(TASK.solution(p)) for p in problems], seed=1)


@pytest.fixture(scope="module")
def built():
    """The example's warmed-up tiny Qwen2 and its tokenizer (tags added), built once for the module."""
    args = EX.parse_args([])
    return EX.load_model(args, TASK, TASK.make_problems(400, seed=args.seed + 2, start_qid=200_000))


def _trainer(out: Path, built, argv=(), **rollout_kwargs):
    trainer, rollout_func, _ = EX.build_trainer(EX.parse_args(list(argv)), out, built)
    for k, v in rollout_kwargs.items():
        setattr(rollout_func, k, v)
    return trainer, rollout_func


def _any_tool_call(prompt, completion: str) -> bool:
    return "</tool>" in completion  # a success_fn that lets the policy's steps into the buffer as soon as it calls


# -- 1. tags -------------------------------------------------------------------------------------------------------
def test_tags_that_are_not_single_tokens_are_refused_with_the_remedy(raw, tmp_path):
    from rapo_fast.integrations.trl import RAPOGRPOTrainer, make_rollout_func

    model, tok = raw
    assert tok.unk_token_id is None and tok.convert_tokens_to_ids("</tool>") is None  # Qwen2.5's situation
    with pytest.raises(ValueError, match=r"</tool> is not in the vocabulary.*add_rapo_tags\(tokenizer, model\)"):
        make_rollout_func(TASK, tokenizer=tok)
    # the tokenizer left to the trainer: refused when the trainer is built, before any step
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        report_to="none",
        max_steps=1,
    )
    with pytest.raises(ValueError, match="add_rapo_tags"):
        RAPOGRPOTrainer(
            model=model,
            reward_funcs=[_zero],
            args=config,
            train_dataset=_dataset(),
            processing_class=tok,
            rollout_func=make_rollout_func(TASK),
        )


def test_a_tag_mapped_to_unk_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rapo_fast.integrations.trl import check_rapo_tags

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>", "<tool>", "<retrieve>", "</retrieve>", "1"])}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    assert tok.convert_tokens_to_ids("</tool>") == tok.unk_token_id  # every sampled <unk> would end a tool step
    with pytest.raises(ValueError, match="</tool> is not in the vocabulary"):
        check_rapo_tags(tok)


def test_add_rapo_tags_makes_each_tag_one_token_and_resizes_the_model(raw):
    import copy

    from rapo_fast.integrations.trl import add_rapo_tags, check_rapo_tags

    model, tok = copy.deepcopy(raw[0]), copy.deepcopy(raw[1])
    assert add_rapo_tags(tok, model) == 4
    check_rapo_tags(tok)
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == model.get_output_embeddings().weight.shape[0]
    ids = tok.encode("a <tool> 1 + 2 </tool>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("</tool>") == ids[-1]
    # not special tokens: TRL's decode for the reward functions (skip_special_tokens=True) keeps their text
    assert "</tool>" in tok.decode(ids, skip_special_tokens=True)
    assert add_rapo_tags(tok, model) == 0


def _zero(completions, **_):
    return [0.0] * len(completions)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "calc 1 add 2"}]] * 4})


# -- 2, end to end: chat prompts, retrieval, masks, buffer growth ----------------------------------------------------
def test_chat_prompts_end_to_end_two_steps(built, tmp_path):
    trainer, rollout_func = _trainer(tmp_path, built, ["--prompts-per-step", "4"], success_fn=_any_tool_call)
    tok = trainer.processing_class
    size0, batches = len(rollout_func.traces), []
    original = RAPOGRPOTrainer_generate = type(trainer)._generate_and_score_completions

    def recording(self, inputs):
        out = original(self, inputs)
        batches.append((inputs, {k: v for k, v in out.items() if torch.is_tensor(v)}))
        return out

    trainer._generate_and_score_completions = recording.__get__(trainer)
    trainer.train()
    assert trainer.state.global_step == 2 and RAPOGRPOTrainer_generate is not None
    retrieved = sum(int(b["retrieved_mask"].sum()) for _, b in batches)
    assert retrieved > 0, "no retrieval happened in 2 steps"
    for inputs, b in batches:
        # retrieved tokens and tool turns are out of the loss (tool_mask = the rollout's env_mask)
        assert not (b["tool_mask"].bool() & b["retrieved_mask"]).any()
        # the prompt ids are TRL's own tokenization of the chat prompt
        want = tok.apply_chat_template(
            conversation=[inputs[0]["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        row = b["prompt_ids"][0][b["prompt_mask"][0].bool()].tolist()
        assert row == list(want)
    assert len(rollout_func.traces) > size0, "the buffer did not grow"
    assert rollout_func.traces.num_onpolicy > 0


def test_tool_output_sits_in_the_template_tool_turn_out_of_the_loss(built, tmp_path):
    from rapo_fast.rollouts.batch import KIND_TOOL

    trainer, rollout_func = _trainer(tmp_path, built, ["--prompts-per-step", "4"])
    trainer.model.train()
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(4) for _ in range(4)]
    out = rollout_func(prompts, trainer)
    batch = rollout_func.last_batch
    tool = batch.kinds == KIND_TOOL
    assert tool.any(), "no tool call: the test would prove nothing"
    b = int(tool.any(1).nonzero()[0, 0])
    text = trainer.processing_class.decode(batch.input_ids[b][tool[b]].tolist())
    assert text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n<obs>"), text
    assert text.endswith("</obs>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
    p = int(batch.prompt_len[b])
    env = torch.tensor(out["env_mask"][b])
    assert (env[tool[b, p : p + env.numel()]] == 0).all()


# -- 3. evaluation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("retrieve_at_eval", [False, True])
def test_evaluate_leaves_the_buffer_unchanged(built, tmp_path, retrieve_at_eval):
    trainer, rollout_func = _trainer(tmp_path, built, success_fn=_any_tool_call, retrieve_at_eval=retrieve_at_eval)
    traces = rollout_func.traces
    before = (
        len(traces),
        traces.num_onpolicy,
        {p: list(s) for p, s in traces.payloads.items()},
        traces.buffer.embeddings.clone(),
    )
    calls = []
    original = traces.retrieve
    traces.retrieve = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.evaluate()
    assert (len(traces), traces.num_onpolicy, traces.payloads) == before[:3]
    assert torch.equal(traces.buffer.embeddings, before[3])
    # the eval rollout had hybrid (retrieving) rows only with the switch; without it the buffer was never searched
    assert bool(rollout_func.last_batch.hybrid.any()) == retrieve_at_eval
    assert retrieve_at_eval or not calls


# -- 4. checkpoints --------------------------------------------------------------------------------------------------
def test_resume_from_a_trl_checkpoint_restores_the_buffer_exactly(built, tmp_path):
    from rapo_fast.integrations.trl_checkpoint import TRACES_DIR

    argv = ["--steps", "1", "--save-steps", "1"]
    trainer, rollout_func = _trainer(tmp_path / "run", built, argv, success_fn=_any_tool_call)
    trainer.train()
    saved = rollout_func.traces
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert (ckpt / TRACES_DIR / "CURRENT").is_file()
    assert saved.num_onpolicy > 0, "the buffer did not grow: the test would prove nothing"
    resumed_trainer, resumed = _trainer(tmp_path / "run", built, argv)
    assert len(resumed.traces) != len(saved)  # a fresh seed buffer before the resume
    resumed_trainer.train(resume_from_checkpoint=str(ckpt))
    got = resumed.traces
    assert got.payloads == saved.payloads
    assert (got.num_offpolicy, got.num_onpolicy) == (saved.num_offpolicy, saved.num_onpolicy)
    for name in ("embeddings", "payload_ids", "group_ids", "scores", "pinned"):
        assert torch.equal(getattr(got.buffer, name), getattr(saved.buffer, name)), name


# -- 5. sampling options ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", [{"top_p": 0.9}, {"top_k": 20}, {"repetition_penalty": 1.1}])
def test_unimplemented_sampling_options_are_refused_at_construction(built, tmp_path, option):
    from rapo_fast.integrations.trl import RAPOGRPOTrainer

    trainer, rollout_func = _trainer(tmp_path, built)
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        report_to="none",
        max_steps=1,
        **option,
    )
    kwargs = dict(
        model=trainer.model,
        reward_funcs=trainer.reward_funcs,
        args=config,
        train_dataset=_dataset(),
        processing_class=trainer.processing_class,
        rollout_func=rollout_func,
    )
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        RAPOGRPOTrainer(**kwargs)
    plain = GRPOTrainer(**kwargs)  # TRL's own trainer: refused at the first rollout, before sampling
    with pytest.raises(ValueError, match=name):
        rollout_func([_dataset()[0]["prompt"]] * 4, plain)


# -- 6. wrong objects, types, exports --------------------------------------------------------------------------------
def test_a_step_buffer_as_traces_is_refused_at_construction():
    from rapo_fast import StepBuffer
    from rapo_fast.integrations.trl import make_rollout_func

    with pytest.raises(TypeError, match=r"traces: expected a rapo_fast.StepTraces or None, got StepBuffer.*Traces\("):
        make_rollout_func(TASK, StepBuffer(16, 8))
    with pytest.raises(TypeError, match="got object"):
        make_rollout_func(object())


def test_make_rollout_func_signature_is_typed_and_the_names_come_from_one_module():
    import rapo_fast.integrations.trl as trl_path

    params = inspect.signature(trl_path.make_rollout_func).parameters
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in params.values())
    for name in (
        "RAPOGRPOTrainer",
        "make_rollout_func",
        "StepTraces",
        "HashedNgramEncoder",
        "MiniLMEncoder",
        "add_rapo_tags",
        "StepTracesCheckpoint",
    ):
        assert name in trl_path.__all__ and getattr(trl_path, name) is not None
    with pytest.raises(TypeError, match="unexpected keyword"):
        trl_path.make_rollout_func(TASK, top_p=0.9)


# -- 7. one step form in the buffer, tags of stored steps, retrieval points ------------------------------------------
def _seed_traces(tok, tmp_path, n=6):
    from rapo_fast.demo.tasks import solver_trajectories, write_jsonl
    from rapo_fast.integrations.trl import HashedNgramEncoder, StepTraces

    trajectories = solver_trajectories(TASK, TASK.make_problems(n, seed=3), n_per_query=1, seed=0)
    jsonl = write_jsonl(trajectories, tmp_path / "s.jsonl")
    return StepTraces.from_jsonl(jsonl, HashedNgramEncoder(), tok, top_k=1)


def test_steps_tokenized_before_add_rapo_tags_are_refused_whichever_order(raw, tmp_path):
    import copy

    from rapo_fast.integrations.trl import add_rapo_tags, make_rollout_func

    model, tok = copy.deepcopy(raw[0]), copy.deepcopy(raw[1])
    early = _seed_traces(tok, tmp_path)  # the buffer first: its steps hold the tags as byte-level pieces
    add_rapo_tags(tok, model)
    for kwargs in ({}, {"tokenizer": tok}):
        with pytest.raises(ValueError, match=r"<tool>.*</retrieve>.*built before add_rapo_tags.*add_rapo_tags\("):
            make_rollout_func(TASK, early, **kwargs)
    late = _seed_traces(tok, tmp_path)  # the tags first: accepted, each stored step opens and closes on the tag ids
    make_rollout_func(TASK, late)
    ids = {tok.convert_tokens_to_ids(t) for t in ("<retrieve>", "</retrieve>")}
    assert all({seg[0], seg[-1]} == ids for seg in late.payloads.values())


def test_a_learned_step_in_chat_mode_is_retrieved_in_the_seed_steps_form(built, tmp_path):
    """Steps learned from chat rollouts are stored as the seed steps from JSONL are (`... </tool> <obs> v </obs>`, no
    chat template text), so what a later rollout inserts is `<retrieve> step </retrieve>` in that one form."""
    from rapo_fast._tokens import encode_plain
    from rapo_fast.retrieval.step_traces import strip_retrieve_markers
    from rapo_fast.rollouts.batch import KIND_RET

    trainer, rollout_func = _trainer(tmp_path, built, success_fn=lambda p, c: True, exclude_own_group=False)
    tok, traces = trainer.processing_class, rollout_func.traces
    traces.payloads.clear()  # no seed step retrievable: the second rollout can only retrieve what the first learned
    traces.buffer.reset()
    trainer.model.train()
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(2) for _ in range(4)]
    rollout_func(prompts, trainer)
    first = rollout_func.last_batch
    want = set()  # each tool step of the first rollout, written independently in the seed form
    for (row, start, end), obs_end in zip(first.step_spans.tolist(), first.step_obs_end.tolist()):
        if obs_end > end:
            text = tok.decode(first.input_ids[row, start:end])
            _, opened, call = text.rpartition("<tool>")
            step = strip_retrieve_markers(f"{text} {TASK.execute(call.removesuffix('</tool>') if opened else '')}")
            want.add(tuple(encode_plain(tok, f"<retrieve> {step} </retrieve>")))
    assert want and {tuple(s) for s in traces.payloads.values()} <= want, "a learned step in another form"
    rollout_func(prompts, trainer)
    second = rollout_func.last_batch
    ret = second.kinds == KIND_RET
    assert ret.any(), "nothing retrieved: the test would prove nothing"
    for row in ret.any(1).nonzero()[:, 0].tolist():
        seen = second.input_ids[row][ret[row]].tolist()
        assert any(tuple(seen[i : i + len(w)]) == w for w in want for i in range(len(seen))), tok.decode(seen)
        assert "<|im_start|>" not in tok.decode(seen)


def test_retrieval_points_and_retrievals_are_logged(built, tmp_path):
    """A retrieval happens only at a tool result of a hybrid row: with retrieve_prob=1 and a non-empty buffer, each
    such point retrieves once, and both counts reach TRL's metrics."""
    trainer, rollout_func = _trainer(tmp_path, built, retrieve_prob=1.0)
    trainer.model.train()
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(2) for _ in range(4)]
    rollout_func(prompts, trainer)
    batch, metrics = rollout_func.last_batch, trainer._metrics["train"]
    rows, ends = batch.step_spans[:, 0], batch.step_spans[:, 2]
    points = torch.zeros(batch.batch_size, dtype=torch.long).index_add_(0, rows, (batch.step_obs_end > ends).long())
    points = points * batch.hybrid
    assert points.sum() > 0, "no hybrid row reached a tool result: the test would prove nothing"
    assert torch.equal(batch.num_retrievals(), points)  # a row that never called a tool never retrieved
    assert metrics["rapo/retrieval_points"][-1] == metrics["rapo/retrievals"][-1] == float(points.sum())


# -- 8. the example: a learning signal in its default steps; the missing extra named -------------------------------
def test_the_chat_example_shows_a_learning_signal_in_its_default_steps(built, tmp_path, capsys, monkeypatch):
    import re

    # main() as a user runs it, its warm-up taken from `built` (speed: the same 150 steps on one thread from the same
    # seed and problems, so the same weights; build_trainer copies them and the trainer seeds itself before step 1)
    def load_model(args, task, problems):
        assert args.model is None and vars(args) == vars(EX.parse_args(["--out", str(tmp_path)])), args
        return built

    monkeypatch.setattr(EX, "load_model", load_model)
    assert EX.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"trained (\d+) steps, mean loss \S+, mean reward (\S+), buffer (\d+) -> (\d+) steps", out)
    assert m is not None, out
    steps, reward, before, after = int(m[1]), float(m[2]), int(m[3]), int(m[4])
    assert steps == EX.parse_args([]).steps
    assert reward > 0 or after > before, out


@pytest.mark.parametrize("module", ["datasets", "trl"])
def test_the_examples_without_the_trl_extra_name_it(monkeypatch, module):
    import sys

    arith = importlib.util.spec_from_file_location("rapo_grpo_arith", ROOT / "examples" / "trl" / "rapo_grpo_arith.py")
    mod = importlib.util.module_from_spec(arith)
    arith.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    for example in (EX, mod):
        with pytest.raises(SystemExit, match=rf'{module} is missing: .*pip install -e "\.\[trl\]"'):
            example.main(["--steps", "1"])
