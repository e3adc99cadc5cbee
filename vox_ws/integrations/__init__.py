"""Where the framework clients were first published (`vox_ws.integrations.pipecat`,
`.livekit`): they live in `vox_ws/clients/` now, and these modules keep their names for the
code that imports them so."""
