"""Where finished regions go: spans (:mod:`.otel`) and the in-process summary (:mod:`.summary`)."""
