from backends.sim.text import REPEAT_WORD, FinishReason, OutputPlan, OutputSpec, PieceKind, plan_output


def plan(prompt: str, spec: OutputSpec, seed: int = 0, repeat_token: bool = False) -> OutputPlan:
    return plan_output(
        prompt, spec, seed=seed, answer_tokens=(10, 10), reasoning_tokens=(20, 20), repeat_token=repeat_token
    )


def test_same_prompt_and_seed_give_the_same_output() -> None:
    spec = OutputSpec(max_tokens=50)
    one = plan_output("p", spec, seed=1, answer_tokens=(5, 40), reasoning_tokens=(1, 1))
    assert one == plan_output("p", spec, seed=1, answer_tokens=(5, 40), reasoning_tokens=(1, 1))
    others = {plan(f"p{i}", spec, seed=1).answer for i in range(5)}
    assert len(others) > 1
    assert plan("p", spec, seed=2).answer != plan("p", spec, seed=1).answer


def test_natural_end_is_stop_and_max_tokens_cuts_with_length() -> None:
    stop = plan("p", OutputSpec(max_tokens=10), seed=0)
    assert (len(stop.answer), stop.finish_reason) == (10, FinishReason.STOP)
    cut = plan("p", OutputSpec(max_tokens=4), seed=0)
    assert (len(cut.answer), cut.finish_reason) == (4, FinishReason.LENGTH)
    forced = plan("p", OutputSpec(max_tokens=30, ignore_eos=True), seed=0)
    assert (len(forced.answer), forced.finish_reason) == (30, FinishReason.LENGTH)


def test_reasoning_comes_first_is_cut_by_the_budget_and_counts_against_max_tokens() -> None:
    full = plan("p", OutputSpec(max_tokens=100, thinking=True), seed=0)
    assert (len(full.reasoning), len(full.answer)) == (20, 10)
    kinds = [kind for kind, _ in full.pieces()]
    assert kinds == [PieceKind.REASONING] * 20 + [PieceKind.CONTENT] * 10
    budget = plan("p", OutputSpec(max_tokens=100, thinking=True, thinking_budget=3), seed=0)
    assert (len(budget.reasoning), len(budget.answer), budget.finish_reason) == (3, 10, FinishReason.STOP)
    starved = plan("p", OutputSpec(max_tokens=15, thinking=True), seed=0)
    assert (len(starved.reasoning), starved.answer, starved.finish_reason) == (15, (), FinishReason.LENGTH)


def test_pieces_carry_joining_spaces() -> None:
    out = plan("p", OutputSpec(max_tokens=100))
    assert "".join(text for _, text in out.pieces()) == out.answer_text


def test_repeat_token_fills_the_length_limit() -> None:
    out = plan("p", OutputSpec(max_tokens=7, thinking=True), repeat_token=True)
    assert out.answer == (REPEAT_WORD,) * 7
    assert out.finish_reason is FinishReason.LENGTH
