"""Ray connection (connection), decode actors (actors), their resources (resources), the Jobs API
client (jobs_api) and cluster configs (*.yaml, kuberay/). Depends on aggdec/ only."""
