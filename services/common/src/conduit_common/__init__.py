"""Code shared by the Conduit services: the CONDUIT_* flag mapping, structured-output limits, logging
and the OpenTelemetry set-up. No torch, no gRPC stubs; its one dependency is OpenTelemetry."""
