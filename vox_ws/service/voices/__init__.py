"""The stream service's voices: the ones a client names, registers, shares and fetches.

    service.py        VoiceService: built-in voices, aliases and names, registering on every device
    names.py          what a voice a client names is: built-in, alias, registered id, or name
    aliases.py        aliases (OpenAI's names by default) and the `--voice-aliases` file
    registrations.py  RegistrationQueue: voice registrations waiting, bounded, owners taking turns
    sharing.py        VoiceSharing: public voices, by name to every caller, their owner's to change
    rescans.py        VoiceRescans: the built-in voices a running server serves (a folder that changes)
    fetches.py        VoiceFetches: Piper voices fetched by name into the engine's voices folder
    store.py          registered voices' rules and contract: owners, limits, ids, names (VoiceStore)
    memory_store.py   the store in this process (`memory`)
    directory_store.py  the store in a local directory (`dir:PATH`, the default)
    redis_store.py    the store in Redis, shared by replicas (`redis://...`)
    stores.py         open_store: the store a `--voice-store` spec names

Nothing is imported here: each module is imported by its own name.
"""
