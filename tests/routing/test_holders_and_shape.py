"""Head holders, request shape and the keys that tell identical heads apart."""

from __future__ import annotations

from routing.holders import HeadHolders
from routing.keys import REPLY_CHARS, chat_key, first_reply, reply_key, reply_text
from routing.shape import IMAGE_CHARS, chat_shape, messages_shape


def test_holders_collect_backends_per_head_and_drop_one() -> None:
    h = HeadHolders()
    h.add("k", "a")
    h.add("k", "b")
    h.add("other", "a")
    assert h.get("k") == {"a", "b"}
    h.drop("k", "a")
    assert h.get("k") == {"b"}
    h.drop("k", "b")
    assert h.get("k") == frozenset() and len(h) == 1
    h.drop("missing", "a")
    h.drop("k", "never-seen")


def test_holders_are_bounded_least_recently_recorded_first() -> None:
    h = HeadHolders(max_entries=2)
    h.add("k1", "a")
    h.add("k2", "a")
    h.add("k1", "b")  # k1 is the most recent now
    h.add("k3", "a")
    assert (h.get("k1"), h.get("k2"), h.get("k3")) == ({"a", "b"}, frozenset(), {"a"})


def test_holders_past_the_bound_drop_the_oldest_keys_in_one_batch() -> None:
    # 128 keys: a batch is 2 (128 // 64). Key 0 is recorded again last, so the oldest are 1 and 2.
    h = HeadHolders(max_entries=128)
    for i in range(128):
        h.add(f"k{i}", "a")
    h.add("k0", "b")
    h.add("k128", "a")  # one past the bound: a batch goes, the two least recently recorded
    assert len(h) == 127
    assert h.get("k1") == h.get("k2") == frozenset()
    assert h.get("k3") == {"a"} and h.get("k0") == {"a", "b"} and h.get("k128") == {"a"}
    h.add("k129", "a")  # within the bound again: nothing more goes
    assert len(h) == 128 and h.get("k3") == {"a"}


def test_holders_stay_bounded_over_many_trims() -> None:
    h = HeadHolders(max_entries=100)  # a batch of 1: exactly the latest 100 kept
    for i in range(10_000):
        h.add(f"k{i}", "a", first_turn=True)
        assert len(h) == min(i + 1, 100)
    assert [h.latest(f"k{i}") for i in (9_899, 9_900, 9_999)] == [None, "a", "a"]


def test_shape_counts_head_and_the_tail_since_the_last_reply() -> None:
    msgs = [
        {"role": "system", "content": "s" * 100},
        {"role": "user", "content": "u" * 50},
        {"role": "assistant", "content": "a" * 20},
        {"role": "tool", "content": "t" * 30},
        {
            "role": "user",
            "content": [{"type": "text", "text": "x" * 5}, {"type": "image_url", "image_url": {}}],
        },
    ]
    assert chat_shape(msgs) == (150, 30 + 5 + IMAGE_CHARS, 2)
    assert chat_shape(msgs[:2]) == (150, 150, 1)


def test_shape_counts_tool_call_arguments() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}" * 10}}]}, {"role": "tool", "content": "r"}]  # fmt: skip
    assert chat_shape(msgs) == (1, 1, 2)


def test_messages_shape_counts_system_in_the_head_and_blocks_by_their_text() -> None:
    body = {
        "system": "s" * 100,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "u" * 50}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "input": "i" * 7}]},
            {"role": "user", "content": [{"type": "tool_result", "content": "r" * 30}]},
        ],
    }
    assert messages_shape(body) == (100 + 50 + IMAGE_CHARS, 30, 2)
    first = {**body, "messages": body["messages"][:1]}
    assert messages_shape(first) == (100 + 50 + IMAGE_CHARS, 100 + 50 + IMAGE_CHARS, 1)


def test_first_reply_is_the_assistant_message_after_the_first_user_message() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "R" * 100}, {"role": "user", "content": "next"},
            {"role": "assistant", "content": "later"}]  # fmt: skip
    assert first_reply(msgs) == "R" * REPLY_CHARS
    assert first_reply(msgs[:2]) is None


def test_reply_text_falls_back_to_the_first_tool_calls_arguments() -> None:
    msg = {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": '{"path": "a"}'}}]}
    assert reply_text(msg) == '{"path": "a"}'
    assert reply_text({"role": "assistant", "content": [{"type": "text", "text": "hi"}]}) == "hi"


def test_twins_get_distinct_keys_once_their_replies_differ_and_equal_ones_otherwise() -> None:
    head = chat_key({"model": "m", "messages": [{"role": "user", "content": "task"}]})
    assert reply_key(head, "first sample") != reply_key(head, "second sample")
    assert reply_key(head, "same" + "x" * 100) == reply_key(head, "same" + "x" * 100 + "tail differs")
    assert reply_key(head, "r") != reply_key(
        chat_key({"model": "m2", "messages": [{"role": "user", "content": "task"}]}), "r"
    )


def test_holders_name_the_backend_of_the_latest_first_turn() -> None:
    h = HeadHolders()
    assert h.latest("k") is None
    h.add("k", "a", first_turn=True)
    h.add("k", "b")  # a follow-up: held there too, but not the latest first turn
    assert (h.get("k"), h.latest("k")) == ({"a", "b"}, "a")
    h.add("k", "b", first_turn=True)
    assert h.latest("k") == "b"
    h.drop("k", "a")
    assert (h.get("k"), h.latest("k")) == ({"b"}, "b")
    h.add("k", "a")
    h.drop("k", "b")  # the latest lost the head: no latest until the next first turn
    assert (h.get("k"), h.latest("k")) == ({"a"}, None)
