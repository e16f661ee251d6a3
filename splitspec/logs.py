"""Structured logs: one JSON object per line on stderr, with the service name and whatever ids
the code bound (session_id, request_id), so a log pipeline can follow one request across
the gateway, target and draft services; with tracing on (splitspec/tracing.py), the trace_id and
span_id of the span running too, so a line leads to its trace."""
from __future__ import annotations

import json
import logging
import sys

import structlog

from splitspec import tracing

LEVELS = ("debug", "info", "warning", "error")


def configure(service: str, level: str = "info", stream=None) -> None:
    if level not in LEVELS:
        raise ValueError(f"--log-level {level!r} is not one of {', '.join(LEVELS)}")
    num = getattr(logging, level.upper())

    def add_service(_, __, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            tracing.log_ids,          # trace_id / span_id while a traced request runs
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(num),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    # grpc and asyncio speak through the standard library; keep their warnings, as JSON too.
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(num, logging.WARNING))


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        event = {"event": record.getMessage(), "logger": record.name, "service": self.service,
                 "level": record.levelname.lower()}
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event)


def get_logger(**ids) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**ids)

