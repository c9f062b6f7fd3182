"""Exceptions: every API error carries its stable `code`.

The daemon answers errors as `{"error": "<message>", "code": "<code>"}`. The
message is for people; the code is stable. Each code maps to one class of a
small family (catch a family, or test `.code`); a code this SDK does not
know still raises, as the base `HutchError`.

Errors that never reached the daemon's answer (connection refused, dropped,
timed out) are `HutchConnectionError`, with the transport's exception as
`__cause__`.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Type


class HutchError(Exception):
    """Base of every exception the SDK raises.

    `code` is the daemon's stable error code (`not_found`, `quota_exceeded`,
    ...), or one of the SDK's own: `connection_error`, `timeout`,
    `transfer_incomplete`, `build_failed`, `http_<status>` (an error answer
    without hutch's JSON body, e.g. from a proxy in front of the daemon).
    `status` is the HTTP status, `None` when there was no answer.
    """

    def __init__(self, message: str, *, code: str, status: Optional[int] = None, body: Any = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.body = body

    def __str__(self) -> str:
        if self.status is None:
            return f"{self.message} ({self.code})"
        return f"{self.message} ({self.status} {self.code})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status!r}, message={self.message!r})"


# ---- families of the daemon's codes


class AuthenticationError(HutchError):
    """The API key is missing, unknown or revoked (`unauthorized`)."""


class PermissionDeniedError(HutchError):
    """The key may not do this: admin-only routes and parameters (`forbidden`)."""


class NotFoundError(HutchError):
    """No such sandbox, process, template, build, grant or key (`not_found`),
    or volume (`volume_not_found`); also another key's."""


class InvalidRequestError(HutchError):
    """The request is malformed or names what does not exist (`invalid_request`,
    `unknown_template`, `image_not_found`, `feature_unavailable`,
    `sandbox_network_isolated`, `method_not_allowed`, `volume_path_invalid`,
    `volume_shrink_refused`, `webhook_url_refused`)."""


class ConflictError(HutchError):
    """The thing changed or is taken (`conflict`, `template_name_taken`,
    `snapshot_name_taken`, `volume_name_taken`, `volume_in_use`), or cannot be done to it as it is
    (`snapshot_unsupported`: a memory layer has no snapshot, fork or pause to
    disk; `class_unsupported`: what a `process` sandbox cannot do;
    `snapshot_not_exportable`: a snapshot of a sandbox on `base`, or
    whose image left the store, is no image archive; `not_movable`: a
    paused sandbox or a snapshot whose files cannot start on another node)."""


class IdempotencyError(HutchError):
    """An Idempotency-Key could not be replayed (`idempotency_conflict`: used
    with another request; `execution_outcome_unknown`: its command still runs
    or its outcome was lost, and it will not be run again)."""


class SandboxNotRunningError(HutchError):
    """The sandbox is starting, suspended, terminating or terminated
    (`sandbox_session_not_running`)."""


class SandboxOnOtherNodeError(HutchError):
    """A call another node forwarded reached a node that is not the
    sandbox's (`sandbox_on_other_node`; the message names the owner).
    Calls a client sends are forwarded to the owner instead."""


class SandboxStartError(HutchError):
    """The sandbox did not start (`sandbox_start_failed`,
    `sandbox_startup_failed`, `sandbox_readiness_timeout`)."""


class FileError(HutchError):
    """A file operation was refused (`invalid_path`, `sandbox_path_*`,
    `sandbox_disk_full`, `sandbox_file_part_*`, `payload_too_large`)."""


class ArchiveError(FileError):
    """An archive was refused (`sandbox_archive_invalid`,
    `sandbox_archive_too_large`)."""


class CapacityError(HutchError):
    """A limit was reached and nothing was made (`quota_exceeded`,
    `sandbox_capacity_unavailable`, `sandbox_command_capacity`,
    `access_grant_capacity`, `storage_full`: the host's sandbox storage)."""


class BuildError(HutchError):
    """A template build was refused (`build_instruction_refused`) or failed
    (`build_failed`, the SDK's own code; `.build` holds the build)."""

    build: Any = None


class PortAccessError(HutchError):
    """The port proxy refused a request (`access_token_*`,
    `sandbox_port_unreachable`)."""


class ServerError(HutchError):
    """The daemon failed (`internal`), is shutting down (`unavailable`), or
    the registry of a pull or an image build on the host failed
    (`registry_error`, `image_build_failed`)."""


# ---- the SDK's own


class HutchConnectionError(HutchError):
    """No answer: the connection failed or broke (`connection_error`), after
    the retries that were safe."""


class HutchTimeoutError(HutchConnectionError):
    """No answer in time (`timeout`)."""


class TransferIncompleteError(HutchError):
    """A streamed answer ended early (`transfer_incomplete`): the daemon cuts a
    download short when it fails part way; nothing partial is kept."""


CODE_CLASSES: Dict[str, Type[HutchError]] = {
    "unauthorized": AuthenticationError,
    "forbidden": PermissionDeniedError,
    "grant_scope": PermissionDeniedError,
    "grant_expired": AuthenticationError,
    "not_found": NotFoundError,
    "invalid_request": InvalidRequestError,
    "unknown_template": InvalidRequestError,
    "image_not_found": InvalidRequestError,
    "image_invalid": InvalidRequestError,
    "image_layer_refused": InvalidRequestError,
    "feature_unavailable": InvalidRequestError,
    "sandbox_network_isolated": InvalidRequestError,
    "method_not_allowed": InvalidRequestError,
    "conflict": ConflictError,
    "template_name_taken": ConflictError,
    "snapshot_name_taken": ConflictError,
    "snapshot_unsupported": ConflictError,
    "class_unsupported": ConflictError,
    "snapshot_not_exportable": ConflictError,
    "not_movable": ConflictError,
    "volume_name_taken": ConflictError,
    "secret_name_taken": ConflictError,
    "volume_in_use": ConflictError,
    "volume_not_found": NotFoundError,
    "secret_not_found": NotFoundError,
    "volume_path_invalid": InvalidRequestError,
    "volume_shrink_refused": InvalidRequestError,
    "webhook_url_refused": InvalidRequestError,
    "usage_range_invalid": InvalidRequestError,
    "idempotency_conflict": IdempotencyError,
    "execution_outcome_unknown": IdempotencyError,
    "sandbox_session_not_running": SandboxNotRunningError,
    "sandbox_on_other_node": SandboxOnOtherNodeError,
    "node_not_found": NotFoundError,
    "node_draining": CapacityError,
    "node_unreachable": ServerError,
    "sandbox_start_failed": SandboxStartError,
    "sandbox_startup_failed": SandboxStartError,
    "sandbox_readiness_timeout": SandboxStartError,
    "invalid_path": FileError,
    "sandbox_path_not_directory": FileError,
    "sandbox_path_unreadable": FileError,
    "sandbox_path_conflict": FileError,
    "sandbox_disk_full": FileError,
    "sandbox_file_part_out_of_order": FileError,
    "sandbox_file_part_mismatch": FileError,
    "payload_too_large": FileError,
    "sandbox_archive_invalid": ArchiveError,
    "sandbox_archive_too_large": ArchiveError,
    "quota_exceeded": CapacityError,
    "sandbox_capacity_unavailable": CapacityError,
    "sandbox_command_capacity": CapacityError,
    "access_grant_capacity": CapacityError,
    "webhook_limit_reached": CapacityError,
    "storage_full": CapacityError,
    "build_instruction_refused": BuildError,
    "access_token_required": PortAccessError,
    "access_token_invalid": PortAccessError,
    "access_token_expired": PortAccessError,
    "access_token_wrong_target": PortAccessError,
    "sandbox_port_unreachable": PortAccessError,
    "internal": ServerError,
    "unavailable": ServerError,
    "registry_error": ServerError,
    "image_build_failed": ServerError,
}


def error_for(code: str, message: str, status: Optional[int] = None, body: Any = None) -> HutchError:
    """The exception of `code`; an unknown code gets the base class."""
    cls = CODE_CLASSES.get(code, HutchError)
    return cls(message, code=code, status=status, body=body)


def error_from_answer(status: int, content: bytes) -> HutchError:
    """The exception for an error answer's status and body."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        message = body.get("error")
        if not isinstance(message, str) or not message:
            message = body["code"]
        return error_for(body["code"], message, status, body)
    text = content[:200].decode("utf-8", "replace").strip()
    return HutchError(
        f"HTTP {status}" + (f": {text}" if text else ""), code=f"http_{status}", status=status, body=text
    )
