"""End-to-end tests against real vLLM engines. A package so its conftest is `e2e.conftest`, not `conftest`."""
