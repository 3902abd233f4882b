"""Queue consumers: RQ workers (`pipeplan worker`) and the job function they share with embedded mode."""
