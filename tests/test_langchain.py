"""LangChain's default ChatOpenAI against a real ``lmspd serve``: Chat Completions and, with
``use_responses_api``, the Responses API; invoke and stream, no exception on any path."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from test_acceptance_restart import Server
from test_v1_compat import server  # noqa: F401  (the module's real server)


@pytest.mark.parametrize("use_responses_api", [False, True])
def test_chat_openai_invoke_and_stream(server: Server, use_responses_api: bool) -> None:  # noqa: F811
    llm = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="sk-no-auth",  # type: ignore[arg-type]
        model="tiny",
        temperature=0,
        max_tokens=6,  # type: ignore[call-arg]
        max_retries=0,
        use_responses_api=use_responses_api,
    )
    messages = [SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello."), HumanMessage("Again?")]
    answer = llm.invoke(messages)
    assert isinstance(answer.content, str | list) and answer.text
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 6
    streamed = "".join(chunk.text for chunk in llm.stream(messages))
    assert streamed == answer.text  # greedy: the same answer, streamed
