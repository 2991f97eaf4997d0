"""Apache Airflow DAG for the nightly batchrun job (TaskFlow API, Airflow 2.x and 3.x).

Copy this file into the DAGs folder and set the Airflow Variable `batchrun_jobs` to the folder
holding nightly.toml (default /opt/batchrun/jobs). Retries are safe because the job resumes:
a retry after a crash (exit 1), a worker kill or an interrupted run (exit 75) runs only the
lines that have no committed result yet. A usage error (2) or too many failed lines (3) fail
the task at once: retrying would give the same answer.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timedelta

from airflow.exceptions import AirflowException, AirflowFailException

try:  # Airflow 3
    from airflow.sdk import dag, task
except ImportError:  # Airflow 2
    from airflow.decorators import dag, task

NO_RETRY = {2: "usage or configuration error", 3: "more lines failed than the spec allows"}


@dag(
    dag_id="batchrun_nightly",
    schedule="30 2 * * *",
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,  # the output's lease would refuse a second run of one date (exit 2)
    default_args={"retries": 3, "retry_delay": timedelta(minutes=10)},
    tags=["batchrun"],
)
def batchrun_nightly():
    @task(execution_timeout=timedelta(hours=8))
    def run_job(ds: str | None = None) -> None:
        from airflow.models import Variable

        jobs = Variable.get("batchrun_jobs", default_var="/opt/batchrun/jobs")
        proc = subprocess.Popen(["batchrun", "job", f"{jobs}/nightly.toml", "--var", f"date={ds}"])
        try:
            code = proc.wait()
        except BaseException:
            # The task was killed or timed out: SIGTERM makes batchrun commit what finished and
            # exit 75, and the retry resumes from there.
            proc.terminate()
            proc.wait(timeout=300)
            raise
        if code in NO_RETRY:
            raise AirflowFailException(f"batchrun exited {code}: {NO_RETRY[code]}")
        if code != 0:
            raise AirflowException(f"batchrun exited {code}; the retry resumes")

    run_job()


batchrun_nightly()
