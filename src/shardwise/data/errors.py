"""The error the data layer raises for input a user can fix."""

from __future__ import annotations

from shardwise.errors import ShardwiseError


class DataError(ShardwiseError, ValueError):
    """A data source, a record key, a task name or a length does not fit.

    A `ValueError` too, so callers that only know the builtin hierarchy catch it; the CLI
    prints the message and exits with status 2 like any `ShardwiseError`.
    """
