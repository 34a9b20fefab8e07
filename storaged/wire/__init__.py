"""What storaged's server and client both speak, beside the gRPC proto: the data plane's frames,
the step fence page's layout, the session metadata key, and the status codes (gRPC's numbers).
Neither side imports the other; both import this."""
