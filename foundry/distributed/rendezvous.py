"""Where the machines of a job meet: ``foundry train --nnodes N --rdzv-endpoint HOST:PORT`` and the launchers'
variables that set the same, checked before torchrun starts; a rendezvous that gives up after ``--rdzv-timeout-s``
saying how many nodes came.

Each machine's launcher joins torchrun's c10d rendezvous at the endpoint (node rank 0 hosts its store; without
``--node-rank``, the machine whose hostname is the endpoint's). Once all ``nnodes`` arrived, each starts its ranks,
and ``NodeWatch`` notices a node that stops answering while they train. Unset options are read from the variables
launchers set, as torchrun does: Kubeflow's ``PET_*``, then Slurm's.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import pickle
import socket
import time
from collections.abc import Mapping

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from foundry.errors import ConfigError, LostRankError, TrainingError

DEFAULT_RDZV_TIMEOUT_S = 300.0
BACKEND = "foundry-c10d"  # torchrun's c10d rendezvous, whose timeout says how many nodes arrived
START_TIMEOUT_VARIABLE = "FOUNDRY_START_TIMEOUT_S"  # tells the ranks how long their process group may take to start
NODE_RANK_VARIABLE = "FOUNDRY_NODE_RANK"  # the ranks' --node-rank, which their messages name (torchrun numbers its own)

# Each option's variables, first set wins (after the command line). Kubeflow's TrainJob and PyTorchJob set PET_*,
# which torchrun reads too; Slurm sets SLURM_* in each task of `srun`.
ENV_DEFAULTS: dict[str, tuple[str, ...]] = {
    "nnodes": ("PET_NNODES", "SLURM_NNODES"),
    "nproc": ("PET_NPROC_PER_NODE",),
    "node_rank": ("PET_NODE_RANK", "SLURM_NODEID"),
    "rdzv_endpoint": ("PET_RDZV_ENDPOINT", "PET_MASTER_ADDR"),  # PET_MASTER_ADDR with PET_MASTER_PORT
    "rdzv_id": ("PET_RDZV_ID", "SLURM_JOB_ID"),
}
_FLAGS = {"nnodes": "--nnodes", "nproc": "--nproc", "node_rank": "--node-rank", "rdzv_endpoint": "--rdzv-endpoint"}


@dataclasses.dataclass(frozen=True)
class Nodes:
    """The machines of a job, as this machine's launcher sees them."""

    nnodes: int = 1
    nproc: int | None = None  # ranks on this machine; None: not given (one, and no launcher for one machine)
    node_rank: int | None = None  # None: the rendezvous numbers the machines
    endpoint: str | None = None  # HOST:PORT every machine reaches
    timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    rdzv_id: str = "foundry"

    @property
    def world_size(self) -> int:
        return (self.nproc or 1) * self.nnodes

    def rank_environment(self) -> dict[str, str]:
        """What this machine's ranks learn from their launcher: the start timeout and the node rank it was given."""
        given_rank = {} if self.node_rank is None else {NODE_RANK_VARIABLE: str(self.node_rank)}
        return {START_TIMEOUT_VARIABLE: str(self.timeout_s), **given_rank}


def job_nodes(options: Mapping[str, object], default_rdzv_id: str, env: Mapping[str, str] = os.environ) -> Nodes:
    """The job's nodes from the command line's ``options`` (None where not given), else the launchers' variables.

    ``default_rdzv_id``: the rendezvous id when neither ``--rdzv-id`` nor a launcher's variable gives one (the run
    name), so two jobs on one endpoint host do not join each other. Raises ConfigError, naming the flag or
    variable, for a value that cannot work.
    """
    values: dict[str, object] = {}
    for option, variables in ENV_DEFAULTS.items():
        given = options.get(option)
        source = _FLAGS.get(option, f"--{option.replace('_', '-')}")
        if given is None:
            variable = next((name for name in variables if env.get(name)), None)
            if variable is not None:
                given, source = env[variable], f"${variable}"
                if variable == "PET_MASTER_ADDR":
                    given = f"{given}:{env.get('PET_MASTER_PORT', '29500')}"
                    source = "$PET_MASTER_ADDR:$PET_MASTER_PORT"
        if given is not None and option in ("nnodes", "nproc", "node_rank"):
            given = _whole_number(given, source, minimum=0 if option == "node_rank" else 1)
        values[option] = given
        values[f"{option}_source"] = source
    nodes = Nodes(
        nnodes=values["nnodes"] or 1,
        nproc=values["nproc"],
        node_rank=values["node_rank"],
        endpoint=values["rdzv_endpoint"],
        timeout_s=_timeout(options.get("rdzv_timeout_s")),
        rdzv_id=str(values["rdzv_id"] or default_rdzv_id),
    )
    _check(nodes, values)
    return nodes


def _whole_number(value: object, source: str, minimum: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ConfigError(f"{source} is {value!r}; it takes a whole number of at least {minimum}.")
    return number


def _timeout(value: object) -> float:
    if value is None:
        return DEFAULT_RDZV_TIMEOUT_S
    if not float(value) > 0:
        raise ConfigError(f"--rdzv-timeout-s is {value}; give the seconds the nodes may take to meet, e.g. 300.")
    return float(value)


def _check(nodes: Nodes, values: Mapping[str, object]) -> None:
    if nodes.node_rank is not None and nodes.node_rank >= nodes.nnodes:
        raise ConfigError(
            f"{values['node_rank_source']} is {nodes.node_rank} but the job has {nodes.nnodes} node(s) "
            f"({values['nnodes_source']}): node ranks run from 0 to {nodes.nnodes - 1}. Give each machine its own "
            "rank in that range, or leave --node-rank out and let the rendezvous number them."
        )
    if nodes.endpoint is None:
        if nodes.nnodes > 1:
            raise ConfigError(
                f"{values['nnodes_source']} is {nodes.nnodes}, which needs --rdzv-endpoint HOST:PORT, an address every "
                "machine of the job reaches (e.g. the first node's hostname and a free port, like 29500); or "
                "--nnodes 1 to run on this machine only."
            )
        return
    check_endpoint(nodes.endpoint, str(values["rdzv_endpoint_source"]))


def check_endpoint(endpoint: str, source: str = "--rdzv-endpoint") -> None:
    """Refuse an endpoint that is not ``HOST:PORT`` or whose host does not resolve, before any node waits on it."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # [::1]:29500
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{source} is {endpoint!r}; it takes HOST:PORT, e.g. node0:29500.")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"{source} is {endpoint!r}, but the host {host!r} does not resolve on this machine ({reason}). "
            "Give a hostname or address that every machine of the job resolves (e.g. the first node's, as "
            "`hostname -f` prints it there)."
        ) from None


def rendezvous_arguments(nodes: Nodes) -> list[str]:
    """torchrun's rendezvous options for ``nodes`` (``--standalone`` for one machine without an endpoint)."""
    if nodes.endpoint is None:
        return ["--standalone"]  # one machine: torchrun picks a free local port
    register_backend()
    timeout_s = int(max(1, round(nodes.timeout_s)))
    conf = [f"join_timeout={timeout_s}", f"read_timeout={timeout_s}"]  # read: a node waits as long for the store
    if nodes.node_rank is not None:  # node 0 hosts the store; the others only connect (no guess from hostnames)
        conf.append(f"is_host={int(nodes.node_rank == 0)}")
    return [
        f"--rdzv-backend={BACKEND}",
        f"--rdzv-endpoint={nodes.endpoint}",
        f"--rdzv-id={nodes.rdzv_id}",
        f"--rdzv-conf={','.join(conf)}",
    ]


@functools.cache  # once a process: registering a second creator under one name raises
def register_backend() -> None:
    """Register ``BACKEND`` with torchrun: its c10d rendezvous, whose timeout names the nodes that arrived."""

    def create(params: RendezvousParameters) -> RendezvousHandler:
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        join = handler.next_rendezvous

        def next_rendezvous() -> object:
            try:
                return join()
            except RendezvousTimeoutError as error:
                raise RendezvousTimeoutError(str(_nodes_arrived(handler))) from error

        handler.next_rendezvous = next_rendezvous
        handler.get_backend = lambda: BACKEND  # torch checks that the handler is the one asked for
        return handler

    rendezvous_handler_registry.register(BACKEND, create)


def _nodes_arrived(handler: object) -> int | str:
    """How many nodes, this one included, had joined the rendezvous when it timed out (torch keeps them in private
    attributes; "?" where they moved)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    this_node = getattr(handler, "_this_node", None)
    if state is None or this_node is None:
        return "?"
    return len({*getattr(state, "participants", {}), *getattr(state, "wait_list", ()), this_node})


def rendezvous_failure(error: BaseException, nodes: Nodes) -> TrainingError | None:
    """foundry's message for torchrun's rendezvous errors (None for others): the stage, the endpoint, who came."""
    where = f"{nodes.endpoint} (--rdzv-id {nodes.rdzv_id})"
    if isinstance(error, RendezvousTimeoutError):
        arrived = str(error) or "?"
        return TrainingError(
            f"rendezvous: {arrived} of {nodes.nnodes} nodes arrived at {where} within {nodes.timeout_s:g} s "
            "(--rdzv-timeout-s). Start `foundry train` on every node with the same --nnodes, --rdzv-endpoint and "
            f"--rdzv-id, and check that each reaches {nodes.endpoint} (hostname, port, firewall)."
        )
    if isinstance(error, RendezvousConnectionError):  # nothing to fix in the config: exit 1, as for a lost rank
        return LostRankError(
            f"rendezvous: no connection to the rendezvous store at {where}: the launcher that hosts it (node rank 0, "
            "or the machine whose hostname is the endpoint's) has not started, stopped, or cannot be reached. If "
            "training had started, relaunch every node: with autoresume: true the run continues from the last "
            "checkpoint in save_folder."
        )
    if isinstance(error, RendezvousError):
        return TrainingError(f"rendezvous at {where} failed: {error}")
    return None


def store_lost(nodes: Nodes, timeout_s: float = 2.0) -> bool:
    """Whether the rendezvous store of ``nodes`` no longer takes connections, asked from a node that does not host
    it (False on node 0, and where no node rank was given, as the host may be this node, whose store closes with its
    agent)."""
    if nodes.endpoint is None or not nodes.node_rank:
        return False
    host, _, port = nodes.endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return True
    return False


class NodeWatch:
    """Notices a node whose launcher stopped answering the rendezvous while the job runs.

    A machine that vanishes without closing its connections (power, network, a hung host) leaves the others' next
    collective waiting ``dist_timeout`` (10 minutes by default). Its launcher's heartbeat in the rendezvous state
    (every 5 s) stops, though: a node whose heartbeat has not changed for ``silence_s`` (on this machine's clock,
    so clocks that differ between machines do not matter) is lost, unless the rendezvous was closed (a job that
    ended: torchrun's launchers wait for each other before they close it).
    """

    def __init__(self, nodes: Nodes, silence_s: float = 30.0) -> None:
        self.nodes, self.silence_s = nodes, silence_s
        self._backend: C10dRendezvousBackend | None = None
        self._heard: dict[object, tuple[object, float]] = {}  # node -> (its last heartbeat, when it last changed)
        self._ranks: dict[object, int] = {}  # node -> torchrun's number for it

    def lost_node(self) -> str | None:
        """The lost node, described for a message, or None (also while the state cannot be read)."""
        try:
            state = self._state()
        except Exception:  # the agent says it when the store itself is gone
            return None
        if state is None or state.closed or not state.complete:
            return None
        now = time.monotonic()
        self._ranks.update(state.participants)
        for node in self._ranks:
            heartbeat, previous = state.last_heartbeats.get(node), self._heard.get(node)
            if previous is None or (heartbeat is not None and heartbeat != previous[0]):
                self._heard[node] = (heartbeat, now)
            elif now - previous[1] > self.silence_s:  # silent, or dropped as dead by the rendezvous and silent since
                return self._describe(node, now - previous[1])
        return None

    def _state(self) -> object | None:
        if self._backend is None:
            host, _, port = self.nodes.endpoint.rpartition(":")
            store = TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
            self._backend = C10dRendezvousBackend(store, self.nodes.rdzv_id)
        found = self._backend.get_state()
        return None if found is None else pickle.loads(found[0])  # torch's own state, written by its launchers

    def _describe(self, node: object, silent_s: float) -> str:
        number, nproc = self._ranks[node], self.nodes.nproc or 1
        ranks = f"ranks {number * nproc}-{number * nproc + nproc - 1}" if nproc > 1 else f"rank {number}"
        return (
            f"node lost: the launcher on {getattr(node, 'addr', node)} (torchrun's node {number}, {ranks}) stopped "
            f"answering the rendezvous at {self.nodes.endpoint} {silent_s:.0f} s ago: its machine failed, hangs or "
            "lost the network. This node's ranks were stopped. Relaunch every node (on fewer machines if one is "
            "gone): with autoresume: true the run continues from the last checkpoint in save_folder."
        )
