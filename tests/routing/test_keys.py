from __future__ import annotations

from typing import Any

from routing.keys import chat_key, completion_key, head_messages, session_key

SYS = {"role": "system", "content": "You are terse."}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def test_turn_one_and_turn_n_share_a_key() -> None:
    t1 = chat(SYS, {"role": "user", "content": "q1"})
    t3 = chat(
        SYS,
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "tool_calls": []},
        {"role": "user", "content": "q3"},
    )
    assert chat_key(t1) == chat_key(t3)


def test_same_system_prompt_different_first_question_differ() -> None:
    assert chat_key(chat(SYS, {"role": "user", "content": "a"})) != chat_key(
        chat(SYS, {"role": "user", "content": "b"})
    )


def test_model_and_tools_and_system_are_part_of_the_key() -> None:
    base = chat(SYS, {"role": "user", "content": "q"})
    assert chat_key(base) != chat_key({**base, "model": "other"})
    assert chat_key(base) != chat_key({**base, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert chat_key(base) != chat_key(
        chat({"role": "system", "content": "Other."}, {"role": "user", "content": "q"})
    )
    assert chat_key(base) != chat_key(
        chat({"role": "developer", "content": "You are terse."}, {"role": "user", "content": "q"})
    )


def test_tool_order_of_keys_does_not_matter() -> None:
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    t2 = [{"function": {"parameters": {"b": 2, "a": 1}, "name": "f"}, "type": "function"}]
    m = [SYS, {"role": "user", "content": "q"}]
    assert chat_key(chat(*m, tools=t1)) == chat_key(chat(*m, tools=t2))


def test_string_and_single_text_part_are_the_same_content() -> None:
    a = chat({"role": "user", "content": "hello"})
    b = chat({"role": "user", "content": [{"type": "text", "text": "hello"}]})
    assert chat_key(a) == chat_key(b)


def test_images_key_by_url_or_inline_content() -> None:
    def img(url: str) -> dict[str, Any]:
        return chat(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        )

    assert chat_key(img("https://x/a.png")) == chat_key(img("https://x/a.png"))
    assert chat_key(img("https://x/a.png")) != chat_key(img("https://x/b.png"))
    assert chat_key(img("data:image/png;base64,AAAA")) != chat_key(img("data:image/png;base64,AAAB"))
    detail = chat(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "high"}},
            ],
        }
    )
    assert chat_key(detail) == chat_key(img("https://x/a.png"))


def test_framing_cannot_collide() -> None:
    a = chat({"role": "system", "content": "ab"}, {"role": "user", "content": "c"})
    b = chat({"role": "system", "content": "a"}, {"role": "user", "content": "bc"})
    assert chat_key(a) != chat_key(b)


def test_head_stops_at_first_user_message() -> None:
    msgs = [
        SYS,
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"},
        {"role": "user", "content": "v"},
    ]
    assert [m["content"] for m in head_messages(msgs)] == ["You are terse.", "d", "u"]


def test_session_key_overrides_and_depends_on_session_and_model() -> None:
    assert session_key("m", "s1") == session_key("m", "s1")
    assert session_key("m", "s1") != session_key("m", "s2")
    assert session_key("m", "s1") != session_key("n", "s1")


def test_completion_key_uses_the_leading_block() -> None:
    head = "x" * 600
    assert completion_key("m", head + "turn 1", 512) == completion_key("m", head + "turn 1 ... turn 9", 512)
    assert completion_key("m", "short a", 512) != completion_key("m", "short b", 512)
    assert completion_key("m", [1, 2, 3] * 100, 512) == completion_key("m", [1, 2, 3] * 200, 512)
    assert completion_key("m", [head + "a", "other"], 512) == completion_key("m", head + "b", 512)


def test_key_is_a_32_char_hex_digest() -> None:
    k = chat_key(chat({"role": "user", "content": "x"}))
    assert len(k) == 32 and int(k, 16) >= 0


def test_keys_are_stable_across_releases() -> None:
    # Pins in a shared Redis outlive a rolling upgrade: a changed key function would split conversations
    # between old and new replicas. These digests were computed by the release before this test.
    body = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [
            {"role": "system", "content": "S"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {"role": "assistant", "content": "x"},
        ],
    }
    assert chat_key(body) == "1e94ff85459859735399502c294fca00"
    assert session_key("m", "sid-1") == "cbc20790ac828bc957486435accc0d36"
    assert completion_key("m", "hello world " * 100, 512) == "32f06d8a20a5d65b2c8f45a2b64b47dc"
    assert completion_key("m", [1, 2, 3], 512) == "3d749402631bcbb34cc875a894e6e382"
