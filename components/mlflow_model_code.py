"""The file MLflow runs to build the star-elastic pyfunc when it loads one (MLflow's models-from-code).

Logged with every registered model by :func:`components.mlflow_model.log_nested_model`; it constructs the
model object instead of unpickling one. Nothing imports it.
"""

import mlflow

from components.mlflow_model import StarElasticModel

mlflow.models.set_model(StarElasticModel())
