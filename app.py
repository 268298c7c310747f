"""Entry point for `faust -A app worker`: the Switchyard Faust app lives in `streams.service`."""
from streams.service import app

__all__ = ["app"]

if __name__ == "__main__":
    app.main()
