"""The vLLM plugin's tests, a package so that its conftest and helpers do not share module names with tests/'s."""
