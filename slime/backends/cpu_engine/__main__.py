"""`python -m slime.backends.cpu_engine --model-path DIR [--port N] ...`: serve a HF model with SGLang's HTTP API."""

from slime.backends.cpu_engine.server import parse_args, run_server

if __name__ == "__main__":
    args = parse_args()
    try:
        run_server(args)
    except ValueError as error:  # bad settings, e.g. a model path that is not a local folder
        raise SystemExit(f"error: {error}") from None
