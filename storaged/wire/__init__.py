"""What storaged's server and client both speak, beside the gRPC proto: the data plane's frames,
the step fence page's layout, and the session metadata key. Neither side imports the other;
both import this."""
