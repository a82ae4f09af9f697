"""The top layer: what composes the services. The `phaseserve` command (cli), `phaseserve up` (launcher) and
the in-process engine (scheduler policy + model runner, no Redis). Nothing below imports this package."""
