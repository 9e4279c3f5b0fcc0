"""Push wake-ups, pure: which device to wake when (`coalesce`), what a provider is sent
(`requests`), what its answer means (`outcomes`), which registrations are well formed
(`platforms`). The I/O (the push job, the provider clients) is in `egress/push/`."""
