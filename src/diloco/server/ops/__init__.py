"""The operator's side: admin actions, run control, Prometheus and TensorBoard metrics, launching a
server."""
