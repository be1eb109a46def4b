"""The console section of a run: log lines or a progress bar, and how often."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from foundry.core.time import Time, positive_time
from foundry.schema import doc


@dataclasses.dataclass(kw_only=True)
class ConsoleConfig:
    log_to_console: bool = field(default=True, metadata=doc("print metrics to the console"))
    progress_bar: bool = field(default=False, metadata=doc("show a progress bar instead of log lines"))
    console_log_interval: Time = field(default=Time.parse("1ba"), metadata=doc("how often metrics are printed"))

    def __post_init__(self) -> None:
        positive_time(self.console_log_interval, "console_log_interval")
