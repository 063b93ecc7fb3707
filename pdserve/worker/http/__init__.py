"""The worker's HTTP control API: routes, the cluster-credential check, token streams, and
how failures become status codes and `ErrorBody`s."""
